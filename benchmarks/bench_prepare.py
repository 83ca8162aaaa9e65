"""Data preparation: Loom's streaming prepare vs a ``datasets.map`` + ``tokenizers`` batch pipeline.

Corpus: a generated ``.jsonl`` of ``--mb`` MB of English-like text (words drawn from the stdlib's
identifiers and prose, so BPE has real merges to do), one tokenizer (a Loom BPE of 4,096 tokens,
trained once on 2 MB of it) for both contenders. Each contender runs in a fresh child process; its
peak RSS (``VmHWM`` of the main process, ``ru_maxrss`` of its worker processes) and wall / CPU time
are measured there. Rounds alternate (Loom, datasets, Loom, ...) so machine noise hits both alike;
the table holds each contender's median over ``--rounds`` and the ratio of tokens/s at equal
workers (median wall). Same output: the datasets pipeline writes the concatenation of every
document's ids + end token, which must equal Loom's ``train.bin`` + ``val.bin`` byte for byte.

    loom prepare:  workers = 1 (in-process, tokenizers' own Rust threads) and 2 (processes)
    datasets:      load_dataset("json") + .map(encode_batch_fast, batched, num_proc = 1 / 2), then
                   the ids written to a .bin (what a user would write by hand)

Then one single-document ``.txt`` of the same size through Loom (memory flat in document size), and
the data-loading share of a training step: time to build a step's micro-batches (memmap read, with
packing the positions) over the time of the whole step, tiny model, ``--pack`` off and on.

    python benchmarks/bench_prepare.py [--mb 20] [--workers 1 2] [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_no_write, results  # noqa: E402

LOOM = """
import json, resource, sys, time
from loom.config import DataConfig
from loom.data import prepare_data
src, tok, out, workers = sys.argv[1:5]
t0, c0 = time.perf_counter(), time.process_time()
p = prepare_data(DataConfig(source=src, tokenizer=tok, prepared_dir=out, workers=int(workers), max_corpus_mb=0,
                            val_fraction=0.01), progress=False)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0 + kids.ru_utime + kids.ru_stime,
                  "tokens": p.n_train_tokens + p.n_val_tokens, "peak": peak, "workers_peak": kids.ru_maxrss * 1024,
                  "files": [str(p.train_path), str(p.val_path)]}))
"""

DATASETS = """
import json, os, resource, sys, time
import numpy as np
src, tok_path, out, workers = sys.argv[1:5]
t0, c0 = time.perf_counter(), time.process_time()
from datasets import load_dataset
from tokenizers import Tokenizer
tok = Tokenizer.from_file(tok_path)
eot = tok.token_to_id("<|endoftext|>")
ds = load_dataset("json", data_files=src, split="train", cache_dir=out + "/hf")
encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
def encode(batch):
    return {"ids": [e.ids + [eot] for e in encode_batch(batch["text"], add_special_tokens=False)]}
ds = ds.map(encode, batched=True, num_proc=int(workers) if int(workers) > 1 else None, remove_columns=["text"])
n = 0
with open(out + "/all.bin", "wb") as f:
    for batch in ds.iter(batch_size=1000):
        arr = np.fromiter((i for ids in batch["ids"] for i in ids), dtype=np.uint16)
        f.write(arr.tobytes()); n += len(arr)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0 + kids.ru_utime + kids.ru_stime,
                  "tokens": n, "peak": peak, "workers_peak": kids.ru_maxrss * 1024, "files": [out + "/all.bin"]}))
"""


def make_corpus(path: Path, mb: float, seed: int = 0) -> None:
    """``mb`` MB of .jsonl documents (200-3,000 words) drawn from a vocabulary of real words."""
    import keyword
    import string

    vocab = sorted(
        {
            w
            for w in (Path(string.__file__).read_text() + Path(random.__file__).read_text()).split()
            if w.isascii() and len(w) < 14
        }
        | set(keyword.kwlist)
    )
    rng, n = random.Random(seed), 0
    with path.open("w") as f:
        while n < mb * 1e6:
            line = json.dumps({"text": " ".join(rng.choices(vocab, k=rng.randint(200, 3000)))}) + "\n"
            f.write(line)
            n += len(line)


def run(script: str, *args: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def loading_share(pack: bool, steps: int = 8) -> tuple[float, float]:
    """(data seconds, step seconds) per step of a tiny model on the stdlib corpus, packing off/on."""
    from loom.config import DataConfig
    from loom.data import BatchSampler, TokenDataset, prepare_data
    from loom.model.llama import build_model, loss_fn
    from tests.helpers import tiny_model

    data = prepare_data(DataConfig(vocab_size=512, max_corpus_mb=2), progress=False)
    ds = TokenDataset(data.train_path, 256, pack_eot=data.eot_id if pack else None)
    sampler = BatchSampler(ds, global_batch=8, micro_batch=4, seed=0)
    model = build_model(tiny_model(vocab_size=data.vocab_size, max_seq_len=256, dim=64), seed=0)
    t_data = t_step = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        batches = sampler.micro_batches(step)
        t1 = time.perf_counter()
        for x, y, *packed in batches:
            loss_fn(model(x, *packed), y).backward()
        t_data += t1 - t0
        t_step += time.perf_counter() - t0
    return t_data / steps, t_step / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    add_no_write(ap)
    args = ap.parse_args()
    pipelines = (("loom prepare", LOOM), ("datasets.map+tokenizers", DATASETS))
    with results("prepare", "Data preparation", write=not args.no_write, preformatted=True):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            corpus, small = root / "corpus.jsonl", root / "small.jsonl"
            make_corpus(corpus, args.mb)
            make_corpus(small, 2.0, seed=1)
            from loom.config import DataConfig
            from loom.data import prepare_data

            tok = prepare_data(
                DataConfig(source=str(small), vocab_size=4096, prepared_dir=str(root / "tok")), progress=False
            ).tokenizer_path
            print(
                f"corpus {args.mb:.0f} MB (.jsonl), tokenizer BPE 4096, {os.cpu_count()} cores; load "
                f"{os.getloadavg()[0]:.1f} at the start; medians of {args.rounds} alternating rounds"
            )
            runs: dict[tuple[str, int], list[dict]] = {}
            outputs = set()
            for r in range(args.rounds):
                for w in args.workers:
                    for name, script in pipelines:
                        out = root / f"{name.split()[0]}-{w}-{r}"
                        out.mkdir()
                        dest = out / "data" if name == "loom prepare" else out
                        res = run(script, str(corpus), str(tok), str(dest), str(w))
                        outputs.add(b"".join(Path(f).read_bytes() for f in res["files"]))
                        runs.setdefault((name, w), []).append(res)
                        subprocess.run(["rm", "-rf", str(out)], check=True)
            print(
                f"{'pipeline':<24} {'workers':>7} {'wall s':>8} {'cpu s':>8} {'Mtok/s':>8} {'MB/s':>7} "
                f"{'peak MiB':>9} {'worker MiB':>10}"
            )
            med: dict[tuple[str, int], dict[str, float]] = {}
            for (name, w), rs in runs.items():
                m = med[(name, w)] = {k: statistics.median(x[k] for x in rs) for k in ("wall", "cpu", "peak")}
                m["workers_peak"] = statistics.median(x["workers_peak"] for x in rs)
                tokens = rs[0]["tokens"]
                print(
                    f"{name:<24} {w:>7} {m['wall']:>8.1f} {m['cpu']:>8.1f} {tokens / m['wall'] / 1e6:>8.2f} "
                    f"{args.mb / m['wall']:>7.2f} {m['peak'] / 2**20:>9.0f} {m['workers_peak'] / 2**20:>10.0f}"
                )
            for w in args.workers:
                a, b = med[("loom prepare", w)], med[("datasets.map+tokenizers", w)]
                print(
                    f"workers {w}: loom / datasets tokens per second {b['wall'] / a['wall']:.2f}x (wall), "
                    f"{b['cpu'] / a['cpu']:.2f}x (CPU); peak RSS main {a['peak'] / b['peak']:.2f}x"
                )
            print(f"same token bytes from every pipeline, worker count and round: {len(outputs) == 1}")
            txt = root / "one.txt"
            with txt.open("w") as f:  # the same text as one document
                for line in corpus.open():
                    f.write(json.loads(line)["text"] + "\n")
            res = run(LOOM, str(txt), str(tok), str(root / "txt"), str(max(args.workers)))
            print(
                f"one {txt.stat().st_size / 1e6:.0f} MB .txt document through loom prepare ({max(args.workers)} "
                f"workers): {res['wall']:.1f} s, peak RSS {res['peak'] / 2**20:.0f} MiB main, "
                f"{res['workers_peak'] / 2**20:.0f} MiB workers"
            )
        for pack in (False, True):
            t_data, t_step = loading_share(pack)
            print(
                f"data loading, pack={str(pack).lower():<5}: {t_data * 1e3:.2f} ms of a {t_step * 1e3:.1f} ms step "
                f"({100 * t_data / t_step:.2f}%)"
            )


if __name__ == "__main__":
    main()
