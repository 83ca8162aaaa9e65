"""``loom export hf RUN_OR_CHECKPOINT OUT_DIR``: a Hugging Face model directory from a checkpoint of
any layout.

Writes ``config.json``, ``generation_config.json``, safetensors shards of at most
``max_shard_bytes`` with ``model.safetensors.index.json``, and the run's tokenizer. Tensors are
streamed one at a time from the checkpoint reader (which assembles ZeRO, tensor and pipeline
pieces), so peak memory is one output shard plus the largest tensor. The directory is built
beside ``OUT_DIR`` and renamed into place when complete; an existing non-empty ``OUT_DIR`` is
never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from loom import config as C
from loom.checkpoint.format import CheckpointError, fsync_dir
from loom.checkpoint.load import CheckpointReader
from loom.model.hf import INDEX, architecture_of, hf_config, hf_tensors, hf_units, moe_export_problem

PREFIX = "model."


@dataclass(frozen=True)
class Exported:
    out: Path
    checkpoint: Path
    step: int
    shards: int
    tensors: int
    total_bytes: int


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names packed greedily into shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def _tokenizer_files(run_dir: Path, cfg: C.LoomConfig, tmp: Path) -> dict[str, int]:
    """Copy the run's ``tokenizer.json`` and describe it for ``AutoTokenizer``; returns its special ids."""
    from loom.data.tokenizer import eot_id, load_tokenizer

    src = next(
        (
            p
            for p in (
                run_dir / "tokenizer.json",
                Path(cfg.data.tokenizer or "-"),
                Path(cfg.data.prepared_dir or "-") / "tokenizer.json",
            )
            if p.is_file()
        ),
        None,
    )
    if src is None:
        return {}
    shutil.copyfile(src, tmp / "tokenizer.json")
    tok = load_tokenizer(src)
    eot = eot_id(tok)
    name = tok.id_to_token(eot)
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": name,
                "eos_token": name,
                "model_max_length": cfg.data.seq_len,
            },
            indent=2,
        )
    )
    return {"bos_token_id": eot, "eos_token_id": eot}


def export_hf(
    source: str | Path,
    out: str | Path,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = False,
    wrap: Callable[[CheckpointReader], Any] | None = None,
) -> Exported:
    """Write the Hugging Face directory ``out`` for the checkpoint ``source`` (see module doc).
    ``wrap``: what to read the tensors through instead of the checkpoint reader itself (a LoRA run's
    merged weights: :class:`loom.finetune.export.MergedReader`)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new directory (nothing was written)")
    with CheckpointReader(source) as opened:
        saved = opened.train_state.get("config")
        if not saved:
            raise CheckpointError(
                f"{opened.dir}: has no saved config (train_state.json); cannot describe the model"
            )
        cfg = C.from_dict(saved)
        if cfg.finetune.method != "full" and wrap is None:
            raise CheckpointError(
                f"{opened.dir}: holds LoRA adapters only (finetune.method = {cfg.finetune.method}); "
                "export merged weights with --merge-lora, or the adapters with `loom export peft`"
            )
        reader = opened if wrap is None else wrap(opened)
        architecture_of(
            cfg.model
        )  # a model no Hugging Face family holds fails here, before anything is written
        if cfg.model.moe and (why := moe_export_problem(cfg.moe)) is not None:
            raise CheckpointError(
                f"{opened.dir}: cannot be exported to Hugging Face: {why} (nothing was written)"
            )
        names = [n[len(PREFIX) :] for n in reader.names() if n.startswith(PREFIX)]
        if not names:
            raise CheckpointError(f"{reader.dir}: has no model.* tensors")
        size = {n: reader.dtype(PREFIX + n).itemsize * _numel(reader.global_shape(PREFIX + n)) for n in names}
        units = hf_units(
            cfg.model, names
        )  # the Loom tensors of one HF tensor stay in one shard (GPT-2's c_attn)
        planned = plan_shards(
            [(str(i), sum(size[n] for n in unit)) for i, unit in enumerate(units)], max_shard_bytes
        )
        shards = [[n for i in group for n in units[int(i)]] for group in planned]
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weight_map, total = {}, 0
        bar = _bar(len(names), progress)
        for i, group in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            stream = ((n, reader.read(PREFIX + n)) for n in group)
            tensors = dict(hf_tensors(cfg.model, stream))
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            _fsync(tmp / file)
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            bar.update(len(group))
            del tensors
        bar.close()
        (tmp / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        dtype = str(reader.dtype(PREFIX + names[0])).removeprefix("torch.")
        special = _tokenizer_files(reader.dir.parent.parent, cfg, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg.model, dtype, special), indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"max_length": cfg.data.seq_len, **special}, indent=2)
        )
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return Exported(out, reader.dir, reader.step, len(shards), len(weight_map), total)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="export", unit="tensor")


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000`` (bytes) -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise CheckpointError(f"--max-shard-size: {text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")


def pop_shard_size(args: list[str]) -> int:
    """``--max-shard-size SIZE`` taken out of ``args`` (in place): its bytes, default 5 GB."""
    if "--max-shard-size" not in args:
        return 5 * 10**9
    i = args.index("--max-shard-size")
    if i + 1 >= len(args):
        raise CheckpointError("--max-shard-size: missing value")
    size = parse_size(args[i + 1])
    del args[i : i + 2]
    return size


def main(argv: list[str]) -> int:
    """``loom export hf RUN_OR_CHECKPOINT OUT_DIR [--max-shard-size 5GB]``."""
    args = list(argv)
    size = pop_shard_size(args)
    if len(args) != 3 or args[0] != "hf":
        raise CheckpointError("usage: loom export hf RUN_DIR_OR_CHECKPOINT OUT_DIR [--max-shard-size 5GB]")
    done = export_hf(args[1], args[2], size, progress=True)
    print(
        f"wrote {done.out}: {done.tensors} tensors in {done.shards} shard(s), {done.total_bytes / 1e6:.1f} MB, "
        f"from {done.checkpoint} (step {done.step})"
    )
    return 0
