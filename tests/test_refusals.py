"""A table of concrete bad inputs, each refused the way a user should see it.

Every row is a careless or hostile input (config, data, run directory, checkpoint, environment,
command line). For each: the exit code, exactly one line on stderr, that the line names the field
or the file at fault, and that nothing already on disk changed (every file under the shared
fixtures and the row's own directory is hashed before and after; only the run lock's holder record,
heartbeats and failure logs may be rewritten, as every start rewrites them).

Rows call ``loom.cli.main`` in this process (milliseconds once torch is imported); two run the real
``python -m loom`` entry point. Rows that need a trained run share one tiny run made once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from loom import config as C
from tests.helpers import TINY_JOB, with_sections

ROOT = Path(__file__).resolve().parent.parent
BOOKKEEPING = {".loom.lock", "heartbeat", "logs"}  # rewritten by every start, refused or not
TINY = with_sections(
    TINY_JOB, train={"warmup_steps": 1, "checkpoint_every": 1, "checkpoint_async": False}, run={"nproc": 1}
)


@dataclass
class World:
    """Files shared by every row (never changed by one): a config, prepared data, a trained run, corpora."""

    root: Path
    tiny: Path  # the TINY config as TOML
    data: Path  # its prepared data
    other_data: Path  # another corpus of the same vocabulary size, prepared
    run: Path  # trained 2 steps (checkpoints at 1 and 2, final model)
    corpus: Path  # good and bad corpus files


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from loom.data import prepare_data
    from loom.train.trainer import RankEnv, Trainer

    root = tmp_path_factory.mktemp("world")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOM_CACHE_DIR", str(root / "cache"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        mp.delenv(k, raising=False)
    tiny = root / "tiny.toml"
    tiny.write_text(C.dump_toml(C.from_dict(json.loads(json.dumps(TINY)))))
    data = prepare_data(C.load_toml(tiny).data, progress=False).dir
    other = C.load_toml(tiny)
    other.data.max_corpus_mb = 0.12
    other_data = prepare_data(other.data, progress=False).dir
    run = root / "run"
    cfg = C.load_toml(tiny)
    cfg.run.dir, cfg.data.prepared_dir = str(run), str(data)
    trainer = Trainer(cfg, RankEnv(0, 1, 0, 1))
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()
    corpus = root / "corpus"
    _write_corpus(corpus)
    yield World(root, tiny, data, other_data, run, corpus)
    mp.undo()


def _write_corpus(d: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for sub in (
        "binary",
        "latin",
        "badjson",
        "nofield",
        "notstring",
        "pqcorrupt",
        "pqint",
        "pqcol",
        "csv",
        "empty",
        "chat",
        "gzcut",
        "surrogate",
        "nested",
    ):
        (d / sub).mkdir(parents=True)
    import gzip

    whole = gzip.compress(b"".join(b'{"text": "line %d of a compressed corpus"}\n' % i for i in range(400)))
    (d / "gzcut" / "c.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # a download cut short
    (d / "surrogate" / "c.jsonl").write_text('{"text": "fine"}\n{"text": "half a pair \\ud800 here"}\n')
    (d / "nested" / "c.jsonl").write_text(
        '{"text": "fine"}\n{"text": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    )
    (d / "chat" / "surrogate.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi \\udfff"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    turn = '{"role": "user", "content": "hi"}'
    (d / "chat" / "noassistant.jsonl").write_text(
        f'{{"messages": [{turn}, {{"role": "assistant", "content": "yo"}}]}}\n{{"messages": [{turn}]}}\n'
    )
    (d / "chat" / "role.jsonl").write_text('{"messages": [{"role": "wizard", "content": "hi"}]}\n')
    (d / "binary" / "blob.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00" + bytes(range(256)))
    (d / "latin" / "doc.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (d / "badjson" / "c.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    (d / "nofield" / "c.jsonl").write_text('{"text": "fine"}\n{"body": "elsewhere"}\n')
    (d / "notstring" / "c.jsonl").write_text('{"text": "fine"}\n{"text": ["a", "list"]}\n')
    (d / "pqcorrupt" / "c.parquet").write_bytes(b"PAR1" + os.urandom(64) + b"PAR1")
    pq.write_table(pa.table({"text": [1, 2, 3]}), d / "pqint" / "c.parquet")
    pq.write_table(pa.table({"body": ["x", "y"]}), d / "pqcol" / "c.parquet")
    (d / "csv" / "c.csv").write_text("text\nhello\n")


@dataclass
class Ctx:
    """One row's view: the shared world, its own directory, and what it must restore afterwards."""

    w: World
    tmp: Path
    mp: pytest.MonkeyPatch
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def train(self, *args: str, run: Path | None = None) -> list[str]:
        return ["train", str(self.w.tiny), "--run.dir", str(run or self.tmp / "run"), *args]

    def copy_run(self) -> Path:
        dst = self.tmp / "run-copy"
        shutil.copytree(self.w.run, dst)
        return dst

    def copy_data(self) -> Path:
        dst = self.tmp / "data-copy"
        shutil.copytree(self.w.data, dst)
        return dst

    def hold_lock(self, d: Path) -> None:
        from loom.train.run_lock import RunLock

        lock = RunLock(d)
        self.cleanup.append(lock.release)


def _flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _set_token(path: Path, index: int, value: int) -> None:
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[index] = value
    tokens.flush()
    del tokens


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1]


# ----------------------------------------------------------------------------- rows
# Each row: (id, setup(ctx) -> (argv, [strings the line must contain]), expected exit code).


def _cfg(*override: str, names: tuple[str, ...] = ()) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    """A config row: ``loom train`` on the tiny config with ``override``; the line names the first
    override's field (or ``names``)."""
    default = [override[0][2:]] if override and override[0].startswith("--") and "." in override[0] else []
    return lambda c: (c.train(*override), list(names) or default)


def _toml(text: str, *names: str) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    def setup(c: Ctx):
        path = c.tmp / "bad.toml"
        path.write_text(text)
        return ["train", str(path), "--run.dir", str(c.tmp / "run")], list(names) or [str(path)]

    return setup


def _toml_bytes(data: bytes) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    def setup(c: Ctx):
        path = c.tmp / "bad.toml"
        path.write_bytes(data)
        return ["train", str(path), "--run.dir", str(c.tmp / "run")], [str(path), "UTF-8"]

    return setup


def _config_dir(c: Ctx):
    (c.tmp / "cfg.toml").mkdir()
    return ["train", str(c.tmp / "cfg.toml")], [str(c.tmp / "cfg.toml"), "a directory"]


def _source(sub: str, *names: str) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    def setup(c: Ctx):
        return c.train("--data.source", str(c.w.corpus / sub)), ["data.source", *names]

    return setup


def _corpus_below_one_window(c: Ctx):
    """A corpus of fewer tokens than one sequence: refused before any rank starts (no run.dir made)."""
    from loom.cli import main

    (c.tmp / "small.txt").write_text("hello world\n")
    data = ["--data.source", str(c.tmp / "small.txt"), "--data.prepared_dir", str(c.tmp / "pd")]
    assert main(["prepare", str(c.w.tiny), *data]) == 0
    return c.train(*data), ["data.seq_len", str(c.tmp / "pd" / "train.bin")]


def _tokenizer_fifo(c: Ctx):
    fifo = c.tmp / "tok.fifo"
    os.mkfifo(fifo)
    return c.train("--data.tokenizer", str(fifo)), ["data.tokenizer", str(fifo), "a FIFO"]


def _tokenizer_empty_dir(c: Ctx):
    (c.tmp / "tokdir").mkdir()
    return c.train("--data.tokenizer", str(c.tmp / "tokdir")), ["data.tokenizer", "without a tokenizer.json"]


def _source_and_sources(c: Ctx):
    toml = c.tmp / "mix.toml"
    mix = f'sources = [{{ path = "{c.w.corpus / "latin"}" }}]'
    toml.write_text(c.w.tiny.read_text().replace("sources = []", mix))
    return ["train", str(toml), "--run.dir", str(c.tmp / "run"), "--data.source", "stdlib"], [
        "data.source",
        "[[data.sources]]",
    ]


def _resume_other_tokenizer_unrecorded(c: Ctx):
    """A run from before runs recorded their data (no data.json) resuming with another tokenizer."""
    run = c.copy_run()
    (run / "data.json").unlink()
    (run / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes().replace(b'"', b'"', 1) + b" ")
    return c.train("--train.steps", "3", run=run), [str(run / "tokenizer.json"), "not this run's tokenizer"]


def _chat(where: str, *names: str) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    """``data.format = chat`` on a file of ``corpus/chat``; the line names ``file:line``."""

    def setup(c: Ctx):
        path = c.w.corpus / "chat" / where.split(":")[0]
        return c.train("--data.source", str(path), "--data.format", "chat"), ["data.source", where, *names]

    return setup


def _train_bin_a_directory(c: Ctx):
    d = c.copy_data()
    (d / "train.bin").unlink()
    (d / "train.bin").mkdir()  # said to be "missing" before
    return c.train("--data.prepared_dir", str(d)), [
        "data.prepared_dir",
        str(d / "train.bin"),
        "is a directory",
    ]


def _prepared(tamper: Callable[[Path], None], *names: str, verify: bool = False):
    def setup(c: Ctx):
        d = c.copy_data()
        tamper(d)
        if verify:
            return ["prepare", str(c.w.tiny), "--data.prepared_dir", str(d), "--verify"], [
                "data.prepared_dir",
                *names,
            ]
        return c.train("--data.prepared_dir", str(d)), ["data.prepared_dir", *[str(d / n) for n in names]]

    return setup


def _env(env: dict[str, str], *names: str, args: tuple[str, ...] = ()):
    def setup(c: Ctx):
        for k, v in env.items():
            c.mp.setenv(k, v)
        return c.train(*args), list(names)

    return setup


def _resume_damaged(c: Ctx):
    run = c.copy_run()
    shard = sorted(_newest(run).glob("shard-*.safetensors"))[0]
    _flip(shard)
    return c.train("--train.resume", str(_newest(run)), run=run), [str(shard), "content altered"]


def _resume_other_seed(c: Ctx):
    run = c.copy_run()
    return c.train("--train.seed", "7", "--train.steps", "3", run=run), ["train.seed"]


def _resume_other_data(c: Ctx):
    run = c.copy_run()
    return c.train("--data.max_corpus_mb", "0.12", "--train.steps", "3", run=run), [
        str(run),
        "--train.init_from",
    ]


def _resume_fewer_steps(c: Ctx):
    run = c.copy_run()
    return c.train("--train.steps", "1", run=run), ["train.steps", "step 2"]


def _hf_int8(c: Ctx):
    """A Hugging Face directory (exported from the trained run) with one weight stored as int8."""
    import torch
    from safetensors.torch import load_file, save_file

    from loom.cli import main

    hf = c.tmp / "hf"
    assert main(["export", "hf", str(c.w.run), str(hf)]) == 0
    (shard,) = sorted(hf.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if n.endswith("q_proj.weight"))[0]
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return c.train("--model.from_hf", str(hf)), ["model.from_hf", str(shard), name, "I8"]


def _hf_config_not_json(c: Ctx):
    from loom.cli import main

    hf = c.tmp / "hf"
    assert main(["export", "hf", str(c.w.run), str(hf)]) == 0
    (hf / "config.json").write_text("{'model_type': 'llama'}")
    return c.train("--model.from_hf", str(hf)), [str(hf / "config.json"), "not valid JSON"]


def _hf_export(c: Ctx) -> Path:
    from loom.cli import main

    hf = c.tmp / "hf"
    assert main(["export", "hf", str(c.w.run), str(hf)]) == 0
    return hf


def _hf_truncated_shard(c: Ctx, command: str):
    """A download cut short: the shard named by the index ends halfway (refused from its header)."""
    (shard,) = sorted(_hf_export(c).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    argv = (
        ["generate", "--model.from_hf", str(shard.parent)]
        if command == "generate"
        else c.train("--model.from_hf", str(shard.parent))
    )
    return argv, [str(shard), "not a readable safetensors file"]


def _hf_index_not_json(c: Ctx):
    index = _hf_export(c) / "model.safetensors.index.json"
    index.write_text("{'weight_map': {}}")
    return ["generate", "--model.from_hf", str(index.parent)], [str(index), "not valid JSON"]


def _hf_tensor_missing(c: Ctx):
    """The index and shard lack one tensor: refused before any rank starts (nothing written to run.dir)."""
    from safetensors.torch import load_file, save_file

    hf = _hf_export(c)
    (shard,) = sorted(hf.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if n.endswith("down_proj.weight"))[0]
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    return c.train("--model.from_hf", str(hf)), ["model.from_hf", name, "missing"]


def _hf_tensor_shape(c: Ctx):
    """One tensor of another shape than config.json implies: refused from its header, before any rank starts."""
    from safetensors.torch import load_file, save_file

    (shard,) = sorted(_hf_export(c).glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if n.endswith("up_proj.weight"))[0]
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return c.train("--model.from_hf", str(shard.parent)), [str(shard), name, "config.json implies"]


def _resume_older_checkpoint_manifest_rewritten(c: Ctx):
    """An older checkpoint named directly: its manifest rewritten (as with a shard edited together
    with its hash) no longer has the hash ``latest`` keeps for it."""
    run = c.copy_run()
    older = sorted((run / "checkpoints").glob("step-*"))[0]
    manifest = older / "manifest.json"
    m = json.loads(manifest.read_text())
    m["note"] = "edited with its shard"
    manifest.write_text(json.dumps(m))
    return c.train("--train.resume", str(older), "--train.steps", "3"), [str(manifest), "SHA-256"]


def _latest_points_into_another_run(c: Ctx):
    run = c.copy_run()
    other = c.tmp / "other"
    shutil.copytree(c.w.run, other)
    latest = run / "checkpoints" / "latest"
    record = json.loads(latest.read_text())
    record["tag"] = f"../../other/checkpoints/{record['tag']}"
    latest.write_text(json.dumps(record))
    return c.train("--train.steps", "3", run=run), [str(latest), "outside this run"]


def _run_dir_inside_a_checkpoint(c: Ctx):
    run = c.copy_run()
    inside = _newest(run) / "run"
    return c.train(run=inside), ["run.dir", str(_newest(run))]


def _run_dir_dangling_link(c: Ctx):
    link = c.tmp / "link"
    link.symlink_to(c.tmp / "nowhere")
    return c.train(run=link), ["run.dir", "dangling link", str(c.tmp / "nowhere")]


def _run_entry_link_loop(c: Ctx):
    run = c.tmp / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to("checkpoints")  # found inside the ranks before: "File exists"
    return c.train(run=run), ["run.dir", str(run / "checkpoints"), "leads nowhere"]


def _run_dir_too_long(c: Ctx):
    run = c.tmp.joinpath(*["e" * 250] * (4096 // 251))  # within PATH_MAX, the checkpoints' paths beyond it
    return c.train(run=run), ["run.dir", "choose a shorter run.dir"]


def _run_dir_name_too_long(c: Ctx):
    return c.train(run=c.tmp / ("x" * 300)), ["run.dir", "more than the file system's"]


def _resume_corrupt_data_record(c: Ctx):
    run = c.copy_run()
    (run / "data.json").write_text("{not json")
    return c.train("--train.steps", "3", run=run), [str(run / "data.json")]


def _resume_not_a_checkpoint(c: Ctx):
    (c.tmp / "empty").mkdir()
    return c.train("--train.resume", str(c.tmp / "empty")), ["train.resume", str(c.tmp / "empty")]


def _resume_a_file(c: Ctx):
    (c.tmp / "model.pt").write_bytes(b"\x80\x04not a checkpoint")
    return c.train("--train.resume", str(c.tmp / "model.pt")), ["train.resume", "model.pt"]


def _run_dir_is_a_file(c: Ctx):
    (c.tmp / "afile").write_text("x")
    return c.train(run=c.tmp / "afile"), ["run.dir", str(c.tmp / "afile")]


def _run_dir_entry_of_another_kind(c: Ctx):
    run = c.tmp / "run"
    (run / "metrics.jsonl").mkdir(parents=True)  # a directory where the run appends its rows
    return c.train(run=run), ["run.dir", str(run / "metrics.jsonl"), "is a directory"]


def _run_dir_of_someone_elses_files(c: Ctx, what: str):
    """A directory that is not a run's (no data identity, no checkpoints) whose files a run would
    replace or append to: a project folder, or a Hugging Face model directory (its tokenizer)."""
    run = c.tmp / what
    run.mkdir()
    names = ("config.toml", "metrics.jsonl") if what == "project" else ("tokenizer.json", "config.json")
    for name in names:
        (run / name).write_text("# mine\n")
    return c.train(run=run), ["run.dir", str(run), *names, "no Loom run wrote"]


def _resume_with_another_optimizer(c: Ctx):
    argv = c.train("--train.resume", str(c.w.run), "--train.steps", "4", "--train.optimizer", "adafactor")
    from loom.plan.auto import check_fits

    check_fits(C.load(str(c.w.tiny), argv[4:]), 1, None)  # the planner's op-count cache, written before
    return argv, ["train.optimizer", "was saved with adamw"]


def _tokenizer_without_eot(c: Ctx):
    """A tokenizer with none of the end-of-document tokens: named before the corpus is read."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.save(str(c.tmp / "tokenizer.json"))
    return c.train("--data.tokenizer", str(c.tmp / "tokenizer.json")), [
        "data.tokenizer",
        str(c.tmp / "tokenizer.json"),
        "end-of-document",
    ]


def _run_dir_under_a_file(c: Ctx):
    (c.tmp / "afile").write_text("x")
    return c.train(run=c.tmp / "afile" / "run"), ["run.dir", str(c.tmp / "afile")]


def _run_dir_in_use(c: Ctx):
    run = c.copy_run()
    c.hold_lock(run)
    return c.train("--train.steps", "3", run=run), ["run.dir", str(run), f"in use by pid {os.getpid()}"]


def _convert_where_nothing_can_be_written(c: Ctx):
    """Refused before the checkpoint is read and hashed, naming the output (a file stands where its
    directory would be: root writes anywhere else)."""
    (c.tmp / "afile").write_text("x")
    out = c.tmp / "afile" / "out.safetensors"
    return ["checkpoint", "convert", str(c.w.run), str(out)], [
        str(out),
        "cannot be written",
        "not a directory",
    ]


def _export_where_nothing_can_be_written(c: Ctx):
    (c.tmp / "afile").write_text("x")
    out = c.tmp / "afile" / "hf"
    return ["export", "hf", str(c.w.run), str(out)], [str(out), "cannot be written"]


def _convert_onto_existing(c: Ctx, what: str):
    """An output path that already holds a file (or is a directory) is never replaced nor written beside."""
    out = c.tmp / "mine.safetensors"
    if what == "file":
        out.write_text("my notes, not a model")
    else:
        out.mkdir()
    return ["checkpoint", "convert", str(c.w.run), str(out)], [str(out), "choose a new path"]


def _convert_edited_manifest_via_latest(c: Ctx):
    run = c.copy_run()
    manifest = _newest(run) / "manifest.json"
    m = json.loads(manifest.read_text())
    m["files"]["index.json"]["sha256"] = ["0" * 64]
    manifest.write_text(json.dumps(m))
    return ["checkpoint", "convert", str(run), str(c.tmp / "out.safetensors")], [str(manifest)]


def _convert_edited_manifest_direct(c: Ctx):
    run = c.copy_run()
    ckpt = _newest(run)
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["index.json"]["sha256"] = ["0" * 64]
    (ckpt / "manifest.json").write_text(json.dumps(m))
    # named directly, it is still checked against the manifest hash ``latest`` keeps for it
    return ["checkpoint", "convert", str(ckpt), str(c.tmp / "out.safetensors")], [
        str(ckpt / "manifest.json"),
        "content altered",
    ]


def _convert_into_source(c: Ctx):
    run = c.copy_run()
    target = _newest(run) / "model.safetensors"
    return ["checkpoint", "convert", str(_newest(run)), str(target)], [str(target), "inside the checkpoint"]


def _convert_truncated_shard(c: Ctx):
    run = c.copy_run()
    shard = sorted(_newest(run).glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    return ["checkpoint", "convert", str(run), str(c.tmp / "o.safetensors")], [str(shard), "truncated"]


def _convert_pickle(c: Ctx):
    (c.tmp / "model.pt").write_bytes(b"\x80\x04\x95pickled")
    return ["checkpoint", "convert", str(c.tmp / "model.pt"), str(c.tmp / "o.safetensors")], [
        "model.pt",
        "pickle",
    ]


def _convert_to_bin(c: Ctx):
    """A safetensors file under a .bin name is read as a pickle by transformers: refused, nothing written."""
    out = c.tmp / "pytorch_model.bin"
    return ["checkpoint", "convert", str(c.w.run), str(out)], [str(out), "name it *.safetensors"]


def _convert_into_running_run(c: Ctx):
    run = c.copy_run()
    c.hold_lock(run)
    return ["checkpoint", "convert", str(c.w.run), str(run / "x.safetensors")], [
        "run.dir",
        str(run),
        "in use",
    ]


def _convert_disk_full(c: Ctx):
    import errno

    from loom.checkpoint import convert

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    c.mp.setattr(convert, "_write_tensor", full)  # the streamed writes of the tensors
    out = c.tmp / "model.safetensors"
    return ["checkpoint", "convert", str(c.w.run), str(out)], [str(out), "No space left on device"]


def _too_many_ranks(c: Ctx):
    """Ranks that each fit but together not (the ~0.4 GiB each process's runtime takes): the count to
    give is named, not the model's width."""
    from loom.plan import auto

    c.mp.setattr(auto, "host_memory_bytes", lambda: 4 * 2**30)
    argv = c.train("--run.nproc", "16", "--train.global_batch", "16", "--train.micro_batch", "1")
    return argv, ["run.nproc: 16 ranks", "4 GiB of host memory", "give --nproc"]


def _export_into_running_run(c: Ctx):
    run = c.copy_run()
    c.hold_lock(run)
    return ["export", "hf", str(c.w.run), str(run / "hf")], ["run.dir", str(run), "in use"]


def _export_into_checkpoints(c: Ctx, fmt: str):
    """An export written inside a checkpoint would go when training prunes it (peft: refused there
    before the run is found not to be LoRA)."""
    run = c.copy_run()
    target = _newest(run) / fmt
    return ["export", fmt, str(run), str(target)], [str(target), "which training prunes"]


def _generate_tampered_final(c: Ctx):
    run = c.copy_run()
    weights = run / "checkpoints" / "final" / "model.safetensors"
    _flip(weights)
    return ["generate", "--run.dir", str(run), "--max_new_tokens", "2"], [str(weights)]


def _generate_final_of_other_weights(c: Ctx):
    """A final model file swapped for one exported from the older checkpoint."""
    from loom.checkpoint.convert import convert

    run = c.copy_run()
    weights = run / "checkpoints" / "final" / "model.safetensors"
    older = sorted((run / "checkpoints").glob("step-*"))[0]
    convert(older, c.tmp / "older.safetensors")
    data = (c.tmp / "older.safetensors").read_bytes().replace(older.name.encode(), _newest(run).name.encode())
    weights.write_bytes(data)
    return ["generate", "--run.dir", str(run), "--max_new_tokens", "2"], [str(weights), "differs"]


def _generate_unfinished(c: Ctx):
    """Checkpoints but no final model: what to do (finish it, or export a checkpoint), not "train first"."""
    run = c.copy_run()
    shutil.rmtree(run / "checkpoints" / "final")
    return ["generate", "--run.dir", str(run)], ["has not finished", f"loom export hf {run}"]


def _generate_lost_tokenizer(c: Ctx):
    run = c.copy_run()
    (run / "tokenizer.json").unlink()
    return ["generate", "--run.dir", str(run)], [str(run / "tokenizer.json"), "restore it"]


def _generate_bad_config(c: Ctx):
    run = c.copy_run()
    (run / "config.toml").write_text("[model\ndim = 3")
    return ["generate", "--run.dir", str(run)], [str(run / "config.toml")]


def _generate_bad_tokenizer(c: Ctx):
    run = c.copy_run()
    (run / "tokenizer.json").write_text('{"version": "nope"}')
    return ["generate", "--run.dir", str(run)], [str(run / "tokenizer.json"), "not the tokenizer this run"]


def _another_tokenizer(c: Ctx, command: str):
    """A run whose tokenizer.json was replaced by another valid one (another corpus's): prompts would
    encode, and exports ship, another tokenizer's ids for the same weights."""
    run = c.copy_run()
    shutil.copyfile(c.w.other_data / "tokenizer.json", run / "tokenizer.json")
    argv = (
        ["generate", "--run.dir", str(run)]
        if command == "generate"
        else ["export", "hf", str(run), str(c.tmp / "hf")]
    )
    return argv, [str(run / "tokenizer.json"), "not the tokenizer this run trained with", "data.json"]


def _generate_missing(c: Ctx):
    return ["generate", "--run.dir", str(c.tmp / "nothing")], ["run.dir", str(c.tmp / "nothing")]


def _verify_flipped(c: Ctx):
    d = c.copy_data()
    _set_token(d / "val.bin", 3, (int(np.fromfile(d / "val.bin", np.uint16)[3]) + 1) % 256)
    return ["prepare", str(c.w.tiny), "--data.prepared_dir", str(d), "--verify"], [
        str(d / "val.bin"),
        "SHA-256",
    ]


def _verify_unprepared(c: Ctx):
    return ["prepare", str(c.w.tiny), "--data.prepared_dir", str(c.tmp / "none"), "--verify"], [
        "data.prepared_dir"
    ]


def _tokenizer_garbage(c: Ctx):
    (c.tmp / "tok.json").write_text("{ this is not a tokenizer")
    return c.train("--data.tokenizer", str(c.tmp / "tok.json")), ["data.tokenizer", str(c.tmp / "tok.json")]


def _prepared_dir_is_a_file(c: Ctx):
    (c.tmp / "pd").write_text("x")
    return c.train("--data.prepared_dir", str(c.tmp / "pd")), ["data.prepared_dir", str(c.tmp / "pd")]


def _prepared_dir_not_empty(c: Ctx):
    (c.tmp / "pd").mkdir()
    (c.tmp / "pd" / "notes.txt").write_text("mine")
    return c.train("--data.prepared_dir", str(c.tmp / "pd")), ["data.prepared_dir", str(c.tmp / "pd")]


def _cache_dir_is_a_file(c: Ctx):
    (c.tmp / "cachefile").write_text("x")
    c.mp.setenv("LOOM_CACHE_DIR", str(c.tmp / "cachefile"))
    return c.train("--data.vocab_size", "301"), ["data.prepared_dir", str(c.tmp / "cachefile")]


def _picture_exists(command: str) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    """A ``--plot``/``--out`` picture path that already holds a file: refused before any work, the file kept."""

    def setup(c: Ctx):
        pic = c.tmp / "mine.png"
        pic.write_bytes(b"a picture of mine")
        metrics = str(c.w.run / "metrics.jsonl")
        argv = (
            ["compare", metrics, metrics, "--plot", str(pic)]
            if command == "compare"
            else ["schedule", "--pp", "2", "--microbatches", "4", "--out", str(pic)]
        )
        option = "--plot" if command == "compare" else "--out"
        return argv, [option, str(pic), "exists", "choose a new path"]

    return setup


def _profile(text: str, *names: str) -> Callable[[Ctx], tuple[list[str], list[str]]]:
    """``--parallel.profile`` naming a file that is not a calibration profile: refused before start
    (it was found at the end of the run: a warning, and no plan_* metrics)."""

    def setup(c: Ctx):
        path = c.tmp / "profile.json"
        path.write_text(text)
        return c.train("--parallel.profile", str(path)), ["parallel.profile", str(path), *names]

    return setup


def _edit_tokenizer(d: Path) -> None:
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<|eot|>"  # still a tokenizer, of the same size
    (d / "tokenizer.json").write_text(json.dumps(tok))


def _flip_token(d: Path) -> None:
    _set_token(d / "train.bin", 100, (int(np.fromfile(d / "train.bin", np.uint16)[100]) + 1) % 256)


ROWS: list[tuple[str, Callable[[Ctx], tuple[list[str], list[str]]], int]] = [
    # config: bounds, finiteness, choices, combinations, types, unknown names
    ("model.dim zero", _cfg("--model.dim", "0"), 2),
    (
        "model.dim not divisible by heads",
        _cfg("--model.n_heads", "3", names=("model.dim", "model.n_heads")),
        2,
    ),
    ("model.n_kv_heads not dividing heads", _cfg("--model.n_kv_heads", "3"), 2),
    ("model.rope_theta zero", _cfg("--model.rope_theta", "0"), 2),
    ("model.norm_eps negative", _cfg("--model.norm_eps", "-1e-5"), 2),
    ("model.dropout one", _cfg("--model.dropout", "1.0"), 2),
    ("model.init_std nan", _cfg("--model.init_std", "nan"), 2),
    (
        "model.top_k above experts",
        _cfg("--model.n_experts", "2", "--model.top_k", "3", names=("model.top_k",)),
        2,
    ),
    (
        "model.mlp gelu with experts",
        _cfg("--model.n_experts", "2", "--model.mlp", "gelu", names=("model.mlp",)),
        2,
    ),
    ("parallel.expert_tp unknown", _cfg("--parallel.expert_tp", "column"), 2),
    ("parallel.expert_tp split without experts", _cfg("--parallel.expert_tp", "split"), 2),
    (
        "model.ffn_dim split experts tp does not divide",
        _cfg(
            *("--model.n_experts", "4", "--model.ffn_dim", "99", "--parallel.expert_tp", "split"),
            *("--parallel.tp", "2", "--run.nproc", "2"),
            names=("model.ffn_dim", "99", "parallel.tp=2", "parallel.expert_tp = split"),
        ),
        2,
    ),
    (
        "parallel.expert_tp split under LoRA",
        _cfg(
            "--parallel.expert_tp",
            "split",
            "--model.n_experts",
            "2",
            "--parallel.tp",
            "2",
            "--run.nproc",
            "2",
            "--finetune.method",
            "lora",
        ),
        2,
    ),
    ("model.norm unknown", _cfg("--model.norm", "batchnorm"), 2),
    ("model.positions unknown", _cfg("--model.positions", "alibi"), 2),
    ("moe.capacity_factor negative", _cfg("--moe.capacity_factor", "-1"), 2),
    ("moe.aux_loss_coef negative", _cfg("--moe.aux_loss_coef", "-0.01"), 2),
    ("moe.z_loss_coef negative", _cfg("--moe.z_loss_coef", "-1e-3"), 2),
    ("moe.bias_update_rate negative", _cfg("--moe.bias_update_rate", "-1e-3"), 2),
    ("moe.score unknown", _cfg("--moe.score", "relu"), 2),
    ("moe.drop_policy unknown", _cfg("--moe.drop_policy", "random"), 2),
    ("moe.n_shared_experts negative", _cfg("--moe.n_shared_experts", "-1"), 2),
    ("model.dim not an integer", _cfg("--model.dim", "wide"), 2),
    ("model unknown key", _cfg("--model.colour", "red"), 2),
    ("data.seq_len one", _cfg("--data.seq_len", "1"), 2),
    ("data.seq_len above max_seq_len", _cfg("--data.seq_len", "64"), 2),
    ("data.vocab_size too small", _cfg("--data.vocab_size", "100"), 2),
    (
        "prepare: data.vocab_size beyond a trainable tokenizer",
        lambda c: (["prepare", "debug", "--data.vocab_size", "4000000000"], ["data.vocab_size", "at most"]),
        2,
    ),
    ("data.val_fraction too large", _cfg("--data.val_fraction", "0.7"), 2),
    ("data.errors unknown", _cfg("--data.errors", "ignore"), 2),
    ("data.max_corpus_mb inf", _cfg("--data.max_corpus_mb", "inf"), 2),
    ("data.workers negative", _cfg("--data.workers", "-1"), 2),
    ("data.format unknown", _cfg("--data.format", "html"), 2),
    ("data.overlong unknown", _cfg("--data.overlong", "wrap"), 2),
    ("data.format chat on the stdlib text", _cfg("--data.format", "chat"), 2),
    ("train.lr negative", _cfg("--train.lr", "-3e-3"), 2),
    ("train.lr infinite", _cfg("--train.lr", "inf"), 2),
    ("train.lr nan", _cfg("--train.lr", "nan"), 2),
    ("train.global_batch zero", _cfg("--train.global_batch", "0"), 2),
    ("train.global_batch not divisible", _cfg("--train.micro_batch", "3", names=("train.global_batch",)), 2),
    ("train.eps negative", _cfg("--train.eps", "-1e-8"), 2),
    ("train.seed negative", _cfg("--train.seed", "-1"), 2),
    ("train.beta2 one", _cfg("--train.beta2", "1.0", names=("train.beta1/beta2",)), 2),
    ("train.precision unknown", _cfg("--train.precision", "fp4"), 2),
    ("train.optimizer unknown", _cfg("--train.optimizer", "lion"), 2),
    ("train.recompute every:0", _cfg("--train.recompute", "every:0"), 2),
    ("train.compress unknown format", _cfg("--train.compress", "mlp=fp4"), 2),
    ("train.steps zero", _cfg("--train.steps", "0"), 2),
    ("train.max_skipped_steps negative", _cfg("--train.max_skipped_steps", "-1"), 2),
    ("run.master_port out of range", _cfg("--run.master_port", "70000"), 2),
    ("run.timeout_s zero", _cfg("--run.timeout_s", "0"), 2),
    ("run.dir empty", _cfg("--run.dir", ""), 2),
    ("run.nproc zero", _cfg("--run.nproc", "0"), 2),
    ("run.nproc more ranks than host memory holds", _too_many_ranks, 2),
    ("run.device unknown", _cfg("--run.device", "tpu"), 2),
    ("run.progress not a boolean", _cfg("--run.progress", "maybe"), 2),
    ("parallel.tp zero", _cfg("--parallel.tp", "0"), 2),
    ("parallel.zero five", _cfg("--parallel.zero", "5"), 2),
    (
        "parallel.offload_params without ZeRO-3",
        _cfg("--parallel.offload_params", "cpu", "--parallel.zero", "2"),
        2,
    ),
    ("parallel.zeropp_qwz without ZeRO-3", _cfg("--parallel.zeropp_qwz", "true"), 2),
    ("parallel.zeropp_qgz_bits three", _cfg("--parallel.zeropp_qgz_bits", "3", "--parallel.zero", "3"), 2),
    (
        "parallel.allreduce butterfly on 3 ranks",
        _cfg(
            "--parallel.allreduce",
            "butterfly",
            "--run.nproc",
            "3",
            "--train.global_batch",
            "6",
            "--train.micro_batch",
            "2",
            names=("parallel.allreduce", "dp*cp = 3"),
        ),
        2,
    ),
    ("parallel.profile not JSON", _profile("{'device': 'cpu'", "not valid JSON"), 2),
    (
        "parallel.profile JSON but not a profile",
        _profile('[{"device": "cpu"}]', "not a calibration profile"),
        2,
    ),
    (
        "parallel.profile with a field the planner cannot read",
        _profile('{"device": "cpu", "gemm_flops": "fast"}', "gemm_flops"),
        2,
    ),
    ("parallel.schedule unknown", _cfg("--parallel.schedule", "zigzag"), 2),
    ("parallel.cp_mode unknown", _cfg("--parallel.cp_mode", "zigzag"), 2),
    (
        "parallel.cp_mode alltoall heads not divisible",
        _cfg("--parallel.cp_mode", "alltoall", "--parallel.cp", "8", "--run.nproc", "8"),
        2,
    ),
    (
        "parallel.cp not splitting the sequence in 2*cp chunks",
        _cfg("--parallel.cp", "3", "--run.nproc", "3", names=("data.seq_len", "2*parallel.cp")),
        2,
    ),
    ("parallel.dp against nproc", _cfg("--run.nproc", "2", "--parallel.dp", "3", names=("run.nproc",)), 2),
    ("unknown section", _cfg("--optim.lr", "1", names=("[optim]",)), 2),
    ("override without value", _cfg("--model.dim", names=("--model.dim",)), 2),
    ("toml syntax error", _toml("[model\ndim = 64\n"), 2),
    ("toml unknown section", _toml("[bogus]\nx = 1\n", "[bogus]"), 2),
    ("toml section not a table", _toml("model = 3\n", "[model]"), 2),
    ("toml wrong type", _toml("[train]\nlr = 'fast'\n", "train.lr"), 2),
    ("config file missing", lambda c: (["train", str(c.tmp / "nope.toml")], [str(c.tmp / "nope.toml")]), 2),
    ("toml not UTF-8", _toml_bytes("[model]\n# caf\xe9\n".encode("latin-1")), 2),
    ("config file a directory", _config_dir, 2),
    # data
    (
        "data.source missing",
        lambda c: (c.train("--data.source", str(c.tmp / "gone")), ["data.source", str(c.tmp / "gone")]),
        2,
    ),
    ("binary corpus", _source("binary", "blob.txt", "binary"), 2),
    ("non-UTF-8 corpus", _source("latin", "doc.txt", "UTF-8"), 2),
    ("JSONL parse error", _source("badjson", "c.jsonl:2", "not valid JSON"), 2),
    ("JSONL .gz truncated", _source("gzcut", "c.jsonl.gz", "truncated or corrupt after line"), 2),
    ("JSONL lone surrogate", _source("surrogate", "c.jsonl:2", "lone surrogate \\ud800 in field 'text'"), 2),
    ("JSONL nested too deeply", _source("nested", "c.jsonl:2", "nested too deeply"), 2),
    ("chat lone surrogate", _chat("surrogate.jsonl:1", "lone surrogate \\udfff"), 2),
    ("data.tokenizer a FIFO", _tokenizer_fifo, 2),
    (
        "data.tokenizer a device",
        _cfg("--data.tokenizer", "/dev/zero", names=("data.tokenizer", "a device")),
        2,
    ),
    ("data.tokenizer a directory without one", _tokenizer_empty_dir, 2),
    ("data.source beside [[data.sources]]", _source_and_sources, 2),
    ("resume without data.json on another tokenizer", _resume_other_tokenizer_unrecorded, 2),
    ("JSONL record without text_field", _source("nofield", "c.jsonl:2", "'text'"), 2),
    ("JSONL text not a string", _source("notstring", "c.jsonl:2", "list"), 2),
    ("parquet unreadable", _source("pqcorrupt", "c.parquet"), 2),
    ("parquet text column of ints", _source("pqint", "c.parquet", "int64"), 2),
    ("parquet without text column", _source("pqcol", "c.parquet", "'text'"), 2),
    ("chat record without an assistant turn", _chat("noassistant.jsonl:2", "no assistant turn"), 2),
    ("chat message of an unknown role", _chat("role.jsonl:1", "'wizard'"), 2),
    ("unsupported file type", _source("csv/c.csv", "c.csv", "unsupported"), 2),
    ("empty source directory", _source("empty", "no .txt"), 2),
    ("corpus shorter than one sequence", _corpus_below_one_window, 2),
    (
        "data.tokenizer missing",
        lambda c: (c.train("--data.tokenizer", str(c.tmp / "t.json")), ["data.tokenizer"]),
        2,
    ),
    ("data.tokenizer not a tokenizer", _tokenizer_garbage, 2),
    (
        "train.bin out-of-vocabulary ids",
        _prepared(lambda d: _set_token(d / "train.bin", 1234, 65000), "train.bin"),
        2,
    ),
    ("train.bin altered in vocabulary", _prepared(_flip_token, "train.bin"), 2),
    (
        "val.bin truncated",
        _prepared(lambda d: (d / "val.bin").write_bytes((d / "val.bin").read_bytes()[:-2]), "val.bin"),
        2,
    ),
    ("val.bin missing", _prepared(lambda d: (d / "val.bin").unlink(), "val.bin"), 2),
    ("train.bin a directory", _train_bin_a_directory, 2),
    ("meta.json not JSON", _prepared(lambda d: (d / "meta.json").write_text("{oops"), "meta.json"), 2),
    ("meta.json without fields", _prepared(lambda d: (d / "meta.json").write_text("{}"), "meta.json"), 2),
    ("tokenizer.json replaced", _prepared(_edit_tokenizer, "tokenizer.json"), 2),
    ("prepared_dir is a file", _prepared_dir_is_a_file, 2),
    ("prepared_dir holds other files", _prepared_dir_not_empty, 2),
    (
        "data.vocab_size against an existing prepared_dir",
        lambda c: (
            c.train("--data.prepared_dir", str(c.w.data), "--data.vocab_size", "400"),
            ["data.vocab_size", "400", str(c.w.data), "300"],
        ),
        2,
    ),
    (
        "verify: out-of-vocabulary ids",
        _prepared(lambda d: _set_token(d / "val.bin", 0, 65535), "val.bin", verify=True),
        2,
    ),
    ("verify: altered token", _verify_flipped, 2),
    ("verify: nothing prepared", _verify_unprepared, 2),
    # run directory
    ("run.dir is a file", _run_dir_is_a_file, 2),
    (
        "run.dir holds a project's config and metrics",
        lambda c: _run_dir_of_someone_elses_files(c, "project"),
        2,
    ),
    ("run.dir is a Hugging Face model directory", lambda c: _run_dir_of_someone_elses_files(c, "hf"), 2),
    ("run.dir entry of another kind", _run_dir_entry_of_another_kind, 2),
    ("run.dir under a file", _run_dir_under_a_file, 2),
    ("run.dir in use", _run_dir_in_use, 2),
    ("resume on other data", _resume_other_data, 2),
    ("resume with other seed", _resume_other_seed, 2),
    ("data.json corrupt", _resume_corrupt_data_record, 2),
    # checkpoints
    (
        "train.resume missing",
        _cfg("--train.resume", "/nonexistent/ckpt", names=("train.resume", "/nonexistent/ckpt")),
        2,
    ),
    ("train.resume holds no checkpoint", _resume_not_a_checkpoint, 2),
    ("train.resume a pickle file", _resume_a_file, 2),
    ("train.resume damaged checkpoint", _resume_damaged, 2),
    ("train.init_from missing", _cfg("--train.init_from", "/nonexistent/w", names=("train.init_from",)), 2),
    (
        "resume with another model width (before any rank starts)",
        lambda c: (
            c.train("--train.steps", "4", "--model.dim", "64", run=c.copy_run()),
            ["model.dim", "was saved with 32, this run has 64"],
        ),
        2,
    ),
    ("train.resume with another optimizer (before any rank starts)", _resume_with_another_optimizer, 2),
    ("data.tokenizer without an end-of-document token", _tokenizer_without_eot, 2),
    (
        "resume with another trained vocabulary (before the corpus is tokenized)",
        lambda c: (
            c.train("--train.steps", "4", "--data.vocab_size", "400", run=c.copy_run()),
            ["data.vocab_size", "300-token tokenizer", "asks for 400"],
        ),
        2,
    ),
    (
        "train.init_from of another model shape",
        lambda c: (
            c.train("--train.init_from", str(c.w.run), "--model.dim", "64"),
            ["train.init_from", "model.tok_embeddings.weight", "(300, 32)"],
        ),
        2,
    ),
    (
        "train.resume: an older checkpoint's manifest rewritten",
        _resume_older_checkpoint_manifest_rewritten,
        2,
    ),
    ("latest names a checkpoint of another run", _latest_points_into_another_run, 2),
    ("run.dir inside a checkpoint", _run_dir_inside_a_checkpoint, 2),
    ("run.dir a dangling link", _run_dir_dangling_link, 2),
    (
        "export: unknown format",
        lambda c: (["export", "onnx", str(c.w.run), str(c.tmp / "o")], ["'onnx'", "hf"]),
        2,
    ),
    ("from_hf: config.json not JSON", _hf_config_not_json, 2),
    ("from_hf: shard truncated (generate)", lambda c: _hf_truncated_shard(c, "generate"), 2),
    ("from_hf: shard truncated (train)", lambda c: _hf_truncated_shard(c, "train"), 2),
    ("from_hf: index not JSON", _hf_index_not_json, 2),
    ("from_hf: a tensor missing", _hf_tensor_missing, 2),
    ("from_hf: a tensor of another shape", _hf_tensor_shape, 2),
    ("convert: manifest edited (latest)", _convert_edited_manifest_via_latest, 2),
    ("convert: manifest edited (direct)", _convert_edited_manifest_direct, 2),
    ("convert: into its own checkpoint", _convert_into_source, 2),
    ("convert: truncated shard", _convert_truncated_shard, 2),
    ("convert: pickle file", _convert_pickle, 2),
    ("convert: to a .bin name", _convert_to_bin, 2),
    ("convert: into a running run", _convert_into_running_run, 2),
    ("convert: disk full", _convert_disk_full, 2),
    ("convert: onto an existing file", lambda c: _convert_onto_existing(c, "file"), 2),
    ("convert: onto a directory", lambda c: _convert_onto_existing(c, "dir"), 2),
    ("convert: into a directory that cannot be written", _convert_where_nothing_can_be_written, 2),
    ("export hf: into a directory that cannot be written", _export_where_nothing_can_be_written, 2),
    (
        "convert: empty path",
        lambda c: (["checkpoint", "convert", "", str(c.tmp / "o.safetensors")], ["empty path"]),
        2,
    ),
    ("convert: usage", lambda c: (["checkpoint", "convert", str(c.w.run)], ["usage"]), 2),
    ("export: into a running run", _export_into_running_run, 2),
    ("export: into a checkpoint", lambda c: _export_into_checkpoints(c, "hf"), 2),
    ("export peft: into a checkpoint", lambda c: _export_into_checkpoints(c, "peft"), 2),
    ("generate: final model altered", _generate_tampered_final, 2),
    ("generate: final model of other weights", _generate_final_of_other_weights, 2),
    ("generate: config.toml broken", _generate_bad_config, 2),
    ("generate: a run that has not finished", _generate_unfinished, 2),
    (
        "export hf of a run's final model directory",
        lambda c: (
            ["export", "hf", str(c.w.run / "checkpoints" / "final"), str(c.tmp / "out")],
            ["holds no checkpoint", "final model", "give the run directory"],
        ),
        2,
    ),
    ("generate: a run that lost its tokenizer", _generate_lost_tokenizer, 2),
    ("generate: tokenizer.json broken", _generate_bad_tokenizer, 2),
    ("generate: tokenizer.json of another run", lambda c: _another_tokenizer(c, "generate"), 2),
    (
        "export hf: an empty option value",
        lambda c: (
            ["export", "hf", str(c.w.run), str(c.tmp / "o"), "--dtype", ""],
            ["--dtype", "empty value"],
        ),
        2,
    ),
    ("export hf: tokenizer.json of another run", lambda c: _another_tokenizer(c, "export"), 2),
    ("generate: no such run", _generate_missing, 2),
    ("generate: empty run.dir", lambda c: (["generate", "--run.dir", ""], ["run.dir"]), 2),
    (
        "generate: option not a number",
        lambda c: (["generate", "--run.dir", str(c.w.run), "--top_k", "many"], ["--top_k"]),
        2,
    ),
    (
        "generate: seed beyond 64 bits",
        lambda c: (["generate", "--run.dir", str(c.w.run), "--seed", str(2**64)], ["--seed", "2**64"]),
        2,
    ),
    (
        "generate: negative temperature",
        lambda c: (["generate", "--run.dir", str(c.w.run), "--temperature", "-1"], ["--temperature"]),
        2,
    ),
    (
        "generate: config override ignored",
        lambda c: (["generate", "--run.dir", str(c.w.run), "--train.lr", "1"], ["train.lr"]),
        2,
    ),
    # environment
    (
        "stale RANK and WORLD_SIZE",
        _env({"RANK": "0", "WORLD_SIZE": "2"}, "RANK", "WORLD_SIZE", "MASTER_ADDR"),
        2,
    ),
    (
        "stale RANK only port missing",
        _env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
        2,
    ),
    (
        "launcher world against layout",
        _env(
            {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
            "parallel",
            "tp*pp*cp",
            args=("--parallel.tp", "2"),
        ),
        2,
    ),
    ("LOOM_CACHE_DIR is a file", _cache_dir_is_a_file, 2),
    ("stale SLURM task variables", _env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_PROCID"), 2),
    ("RANK not below WORLD_SIZE", _env({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1", "WORLD_SIZE=1"), 2),
    ("WORLD_SIZE zero", _env({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"), 2),
    ("LOCAL_WORLD_SIZE zero", _env({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"), 2),
    ("LOOM_STRICT_COMM neither on nor off", _env({"LOOM_STRICT_COMM": "maybe"}, "LOOM_STRICT_COMM"), 2),
    ("OMP_NUM_THREADS not a count", _env({"OMP_NUM_THREADS": "lots"}, "OMP_NUM_THREADS=lots"), 2),
    (
        "MASTER_ADDR that does not resolve",
        _env(
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no.such.host.invalid", "MASTER_PORT": "29558"},
            "MASTER_ADDR=no.such.host.invalid",
        ),
        2,
    ),
    (
        "--nproc beside a launcher's variables",
        _env(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29558",
            },
            "--nproc",
            "WORLD_SIZE=1",
            args=("--nproc", "2"),
        ),
        2,
    ),
    ("run.dir entry a symlink loop", _run_entry_link_loop, 2),
    ("run.dir too long for its checkpoints", _run_dir_too_long, 2),
    ("run.dir name beyond NAME_MAX", _run_dir_name_too_long, 2),
    # values past any use: a hang, an allocation or an overflow deep in a library (an audit, 2026-11-29)
    ("data.workers 100000", _cfg("--data.workers", "100000", names=("data.workers", "at most 1024")), 2),
    ("train.eval_batches 1e12", _cfg("--train.eval_batches", "1000000000000"), 2),
    ("run.timeout_s 1e30", _cfg("--run.timeout_s", "1e30"), 2),
    ("run.timeout_s below a second", _cfg("--run.timeout_s", "1e-9"), 2),
    ("run.preempt_grace_s 1e30", _cfg("--run.preempt_grace_s", "1e30"), 2),
    ("run.threads 1e9", _cfg("--run.threads", "1000000000"), 2),
    ("moe.capacity_factor 1e300", _cfg("--moe.capacity_factor", "1e300"), 2),
    ("parallel.bucket_mb 1e-300", _cfg("--parallel.bucket_mb", "1e-300"), 2),
    ("train.compress a kind twice", _cfg("--train.compress", "mlp=fp8,mlp=bf16"), 2),
    ("run.device cuda on a machine without CUDA", _cfg("--run.device", "cuda"), 2),
    (
        "run.master_addr that does not resolve",
        _cfg("--run.master_addr", "not a host!", "--run.nproc", "2", "--train.global_batch", "4"),
        2,
    ),
    (
        "a TOML string where a number belongs",
        _toml('[model]\ndim = "64"\n', "model.dim", "without quotes"),
        2,
    ),
    (
        "an option without its value",
        lambda c: (c.train("--train.lr", "--model.dim", "64"), ["--train.lr"]),
        2,
    ),
    # bounds before allocation (issue 37): the field and the bytes, nothing allocated
    (
        "model.max_seq_len of 2e9 positions",
        _cfg("--model.max_seq_len", "2000000000", names=("model.max_seq_len", "at most 16,777,216")),
        2,
    ),
    ("model.dim 65536", _cfg("--model.dim", "65536", names=("model.dim", "GiB")), 2),
    (
        "model.vocab_size 1e8",
        _cfg("--model.vocab_size", "100000000", names=("model.vocab_size", "at most")),
        2,
    ),
    (
        "finetune.lora_rank above every layer",
        _cfg("--finetune.method", "lora", "--finetune.lora_rank", "1000000", names=("finetune.lora_rank",)),
        2,
    ),
    (
        "schedule: enormous action list",
        lambda c: (["schedule", "--pp", "1000", "--microbatches", "100000"], ["--microbatches"]),
        2,
    ),
    # silent overrides (issue 37)
    ("train.warmup_steps beyond the run", _cfg("--train.warmup_steps", "1000000000"), 2),
    (
        "parallel.auto with an explicit tp it cannot keep",
        _cfg("--parallel.auto", "true", "--parallel.tp", "3", names=("parallel.tp = 3",)),
        2,
    ),
    ("train.steps below the resumed checkpoint", _resume_fewer_steps, 2),
    (
        "finetune.lora_rank with method full",
        _cfg("--finetune.lora_rank", "8", names=("finetune.lora_rank", "full")),
        2,
    ),
    (
        "parallel.ps_shards without dp_mode ps",
        _cfg("--parallel.ps_shards", "2", names=("parallel.ps_shards", "dp_mode")),
        2,
    ),
    (
        "parallel.reshard_after_forward without ZeRO-3",
        _cfg("--parallel.reshard_after_forward", "false", "--parallel.zero", "2"),
        2,
    ),
    ("parallel.hpz_group without hpZ", _cfg("--parallel.hpz_group", "2"), 2),
    ("parallel.zeropp_qgz_bits without qgZ", _cfg("--parallel.zeropp_qgz_bits", "4"), 2),
    (
        "parallel.offload_dir without disk offload",
        lambda c: (c.train("--parallel.offload_dir", str(c.tmp / "off")), ["parallel.offload_dir"]),
        2,
    ),
    (
        "export: max-shard-size 0",
        lambda c: (
            ["export", "hf", str(c.w.run), str(c.tmp / "hf"), "--max-shard-size", "0"],
            ["--max-shard-size"],
        ),
        2,
    ),
    (
        "export: an unknown --dtype",
        lambda c: (["export", "hf", str(c.w.run), str(c.tmp / "hf"), "--dtype", "fp4"], ["--dtype", "fp4"]),
        2,
    ),
    (
        "export peft: --dtype (the adapters are written as stored)",
        lambda c: (
            ["export", "peft", str(c.w.run), str(c.tmp / "peft"), "--dtype", "bf16"],
            ["--dtype", "loom export peft"],
        ),
        2,
    ),
    (
        "export peft: --max-shard-size (one adapter file)",
        lambda c: (
            ["export", "peft", str(c.w.run), str(c.tmp / "peft"), "--max-shard-size", "1GB"],
            ["--max-shard-size", "loom export peft"],
        ),
        2,
    ),
    ("run.preempt_grace_s negative", _cfg("--run.preempt_grace_s", "-1"), 2),
    ("from_hf: an int8 tensor", _hf_int8, 2),
    # command line
    ("unknown command", lambda c: (["frobnicate"], ["'frobnicate'"]), 2),
    ("stray positional argument", lambda c: (c.train("extra"), ["'extra'"]), 2),
    ("unknown plain option", lambda c: (c.train("--fast", "1"), ["--fast"]), 2),
    ("max-restarts negative", lambda c: (c.train("--max-restarts", "-1"), ["--max-restarts"]), 2),
    ("max-restarts not a number", lambda c: (c.train("--max-restarts", "x"), ["--max-restarts"]), 2),
    ("nproc not a number", lambda c: (c.train("--nproc", "two"), ["--nproc"]), 2),
    ("schedule: config file given", lambda c: (["schedule", str(c.w.tiny)], ["schedule"]), 2),
    (
        "schedule: --out not a picture",
        lambda c: (["schedule", "--out", str(c.tmp / "s.toml")], ["--out", ".png or .svg"]),
        2,
    ),
    (
        "schedule: --out a directory",
        lambda c: (["schedule", "--out", str(c.tmp)], ["--out", "a directory"]),
        2,
    ),
    ("compare: --plot an existing file", _picture_exists("compare"), 2),
    ("schedule: --out an existing file", _picture_exists("schedule"), 2),
    ("config: bad override", lambda c: (["config", str(c.w.tiny), "--train.lr", "-1"], ["train.lr"]), 2),
    (
        "prepare: bad field",
        lambda c: (["prepare", str(c.w.tiny), "--data.vocab_size", "5"], ["data.vocab_size"]),
        2,
    ),
]


def _digest(*roots: Path) -> dict[str, str]:
    """Path -> content hash of everything under ``roots`` (directories listed too), bookkeeping aside."""
    out = {}
    for root in roots:
        for p in root.rglob("*"):
            rel = p.relative_to(root)
            if BOOKKEEPING & set(rel.parts):
                continue
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def test_a_last_update_that_leaves_non_finite_weights_fails_the_run(world, tmp_path, capsys, clean_logging):
    """train.lr 1e300: the step's own gradient is finite, the update is not; the final evaluation finds
    a NaN loss, and the run ends with one line naming train.lr (exit 2), no final checkpoint written
    (it exited 0 with a NaN eval loss and saved the broken weights). A run that never evaluates
    (train.eval_every = 0) is not checked: its next step's non-finite gradient norm would be."""
    from loom.cli import main

    run = tmp_path / "run"
    argv = ["train", str(world.tiny), "--run.dir", str(run), "--train.lr", "1e300", "--train.steps", "1"]
    rc = main([*argv, "--train.eval_every", "1"])  # the default evaluates at the last step too
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("loom: error: step 1: the final evaluation loss is nan"), last
    assert "train.lr = 1e+300" in last and not (run / "checkpoints" / "final").exists()


def test_table_has_enough_rows():
    assert len(ROWS) >= 60 and len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("setup,code", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_refused(world, tmp_path, monkeypatch, capsys, clean_logging, setup, code):
    from loom.cli import main

    ctx = Ctx(world, tmp_path, monkeypatch)
    try:
        argv, names = setup(ctx)
        before = _digest(world.root, tmp_path)
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err
    finally:
        for undo in ctx.cleanup:
            undo()
    lines = err.strip().splitlines()
    assert rc == code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("loom: error: "), lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    after = _digest(world.root, tmp_path)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"changed on disk: {changed[:5]}"


@pytest.mark.parametrize(
    "argv,env,names",
    [
        (["train", "--model.dim", "-4"], {}, ["model.dim"]),
        (["train", "--run.nproc", "1"], {"RANK": "0", "WORLD_SIZE": "4"}, ["RANK=0", "WORLD_SIZE=4"]),
    ],
    ids=["bad field", "stale launcher variables"],
)
def test_refused_by_the_real_entry_point(tmp_path, argv, env, names):
    """``python -m loom``: exit code 2 and one line, before torch is imported (no hang, no traceback)."""
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    e |= {"PYTHONPATH": str(ROOT), "LOOM_CACHE_DIR": str(tmp_path / "cache"), **env}
    p = subprocess.run(
        [sys.executable, "-m", "loom", *argv, "--run.dir", str(tmp_path / "run")],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in names), p.stderr
    assert list(tmp_path.iterdir()) == []


def test_disk_full_during_a_save_names_the_directory_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """A failed ``write`` carries no file name; the refusal names the checkpoint being written."""
    import errno

    import torch

    from loom.checkpoint import format as F
    from loom.checkpoint.format import CheckpointError
    from loom.checkpoint.load import CheckpointReader
    from loom.checkpoint.protocol import ShardedTensor, full_box
    from loom.checkpoint.save import Checkpointer

    def state(v: float) -> dict:
        return {"w": ShardedTensor(torch.full((4,), v), (4,), full_box((4,)))}

    ck = Checkpointer(tmp_path / "checkpoints")
    ck.save(1, state(1.0), {}, {}, blocking=True)
    before = _digest(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(F, "write_safetensors", full)
    with pytest.raises(CheckpointError) as e:
        ck.save(2, state(2.0), {}, {}, blocking=True)
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and str(tmp_path / "checkpoints") in msg, msg
    assert _digest(tmp_path) == before  # the temporary directory is gone, step 1 and ``latest`` untouched
    with CheckpointReader(tmp_path) as reader:
        assert reader.step == 1 and reader.read("w").tolist() == [1.0] * 4


@pytest.mark.parametrize(
    "flag,value", [("--microbatches", "-3"), ("--seq", "0"), ("--devices", "0"), ("--rank", "-1")]
)
def test_plan_verify_names_its_own_flag(world, capsys, flag, value):
    """A bad ``plan verify`` flag is named as the flag, not as the config field it becomes
    (``--microbatches -3`` was reported as ``train.global_batch: must be >= 1, got -24``)."""
    from loom.cli import main

    assert main(["plan", "verify", "--config", str(world.tiny), "--devices", "2", flag, value]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith(f"loom plan verify: error: {flag}: must be >= ")
        and f"got {value}" in lines[0]
    )


def test_resume_of_a_finished_run_at_its_step_keeps_the_final_model(world, tmp_path, clean_logging):
    """``--train.steps`` equal to the finished run's step: no step runs, and the final model and its
    meta.json (step, loss) stay as they were (the loss was rewritten as null)."""
    from loom.cli import main

    run = tmp_path / "run"
    shutil.copytree(world.run, run)
    final = run / "checkpoints" / "final"
    meta = json.loads((final / "meta.json").read_text())
    assert meta["step"] == 2 and isinstance(meta["loss"], float)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    assert main(["train", str(world.tiny), "--run.dir", str(run), "--train.steps", "2"]) == 0
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    (final / "meta.json").unlink()  # no final record (e.g. a run stopped at step 2): the logged loss
    assert main(["train", str(world.tiny), "--run.dir", str(run), "--train.steps", "2"]) == 0
    assert json.loads((final / "meta.json").read_text()) == meta


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "debug", "--plot", "PIC"],
        ["plan", "validate", "--plot", "PIC"],
        ["cluster", "simulate", "--trace", "synthetic", "--plot", "PIC"],
    ],
    ids=["plan", "plan validate", "cluster simulate"],
)
def test_existing_picture_is_never_replaced(tmp_path, capsys, monkeypatch, argv):
    """The other commands that draw a picture (:func:`loom.config.check_picture_path`): an existing
    file at ``--plot`` is refused in one line before any work, and kept."""
    from loom.cli import main

    def too_late(*args, **kwargs):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr("loom.plan.validate.run_layout", too_late)  # a training subprocess per layout
    monkeypatch.setattr("loom.cluster.cli.simulate", too_late)
    pic = tmp_path / "mine.png"
    pic.write_bytes(b"a picture of mine")
    argv = [str(pic) if a == "PIC" else a for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--plot" in lines[0] and str(pic) in lines[0] and "exists" in lines[0], lines
    assert not captured.out and pic.read_bytes() == b"a picture of mine"


def test_a_layer_count_no_planner_walk_could_finish_is_one_line_everywhere(world, tmp_path, capsys):
    """model.n_layers = 10^12 made ``loom plan`` and ``plan validate --runs`` end in a MemoryError
    traceback and ``cluster simulate`` spin for ever (per-layer walks): every entry point refuses it
    in one line naming the field, before any walk."""
    from loom.cli import main

    said = "n_layers: at most 10,000 (the deepest transformers trained have about 1,000), got "
    runs = tmp_path / "runs.toml"
    runs.write_text(
        "[models.m]\ndim = 64\nn_layers = 1000000000000\nn_heads = 4\nn_kv_heads = 4\nvocab_size = 256\n"
        '[[runs]]\nname = "r"\nmodel = "m"\nstack = "pytorch-fsdp"\nlayout = "dp8 zero3 mb1"\n'
        'cluster = { device = "a100-80g", devices_per_node = 8, inter_bandwidth_gbps = 25 }\n'
        'global_batch = 8\nseq_len = 64\ntokens_per_s_per_gpu = 1000\nsource = "x"\n'
    )
    trace = tmp_path / "trace.toml"
    trace.write_text(
        '[[jobs]]\nname = "j"\narrival_s = 0\nsamples = 100\ndevices = 2\n'
        "model = { dim = 64, n_layers = 1000000, n_heads = 4, n_kv_heads = 4 }\n"
    )
    for argv in (
        ["plan", "--config", str(world.tiny), "--model.n_layers", "1000000000000"],
        ["plan", "--config", str(world.tiny), "--model.n_layers", "20000"],
        ["plan", "validate", "--published", "--runs", str(runs)],
        ["cluster", "simulate", "--trace", str(trace), "--policy", "fifo"],
    ):
        assert main(argv) != 0, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (argv, lines)


_PLAN_8B = ["plan", "--model", "llama3-8b", "--device", "h100-sxm", "--world", "64"]


@pytest.mark.parametrize(
    "argv",
    [
        [*_PLAN_8B, "--global-batch", "4611686018427387904"],
        [*_PLAN_8B, "--seq", "4611686018427387904"],
        ["plan", "--config", "debug", "--train.global_batch", "4611686018427387904"],
        ["train", "--nproc", "1", "--data.seq_len", "99999999999"],
    ],
    ids=["plan --global-batch", "plan --seq", "plan train.global_batch", "train data.seq_len"],
)
def test_a_batch_or_sequence_beyond_2_24_is_one_line(capsys, argv):
    """The search enumerates the divisors of the global batch: 4.6e18 sequences ran for hours."""
    from loom.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # plan's own flags: argparse's error exit
        code = e.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "at most 16,777,216 (2^24), got " in lines[0], lines


@pytest.mark.parametrize(
    "args,says",
    [
        (["--model.rope_local_theta", "-1"], "model.rope_local_theta: must be a finite number >= 0"),
        (["--model.sliding_window", "-3"], "model.sliding_window: must be >= 0 (0 = none), got -3"),
        (["--model.attn_softcap", "nan"], "model.attn_softcap: must be a finite number"),
        (["--model.logit_softcap", "inf"], "model.logit_softcap: must be a finite number"),
        (["--model.attn_scale", "-0.5"], "model.attn_scale: must be a finite number >= 0"),
        (
            ["--model.norm_offset", "true", "--model.norm", "layernorm"],
            "model.norm_offset: scales an RMSNorm",
        ),
        (["--model.mlp", "geglu"], "model.mlp: must be one of swiglu | gelu | gelu_tanh | geglu_tanh"),
        (["--model.sliding_window", "4", "--model.window_layers", "0,x"], "model.window_layers: 'all' or"),
        (["--model.data_bos", "x"], "model.data_bos"),
        (["--data.bos", "yes"], "data.bos: must be one of auto | none"),
    ],
    ids=[
        "rope_local_theta",
        "sliding_window",
        "attn_softcap",
        "logit_softcap",
        "attn_scale",
        "norm_offset",
        "mlp",
        "window_layers",
        "unknown field",
        "data.bos",
    ],
)
def test_the_gemma_and_window_fields_refuse_bad_values_in_one_line(capsys, tmp_path, args, says):
    """Each new model field's bad value: exit 2 with one line naming the field, before any rank starts
    and before the run directory is made."""
    from loom.cli import main

    run = tmp_path / "run"
    assert main(["train", "debug", "--nproc", "1", "--run.dir", str(run), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not run.exists()
