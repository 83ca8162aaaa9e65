"""The base a LoRA run fine-tunes, by path and SHA-256: what its checkpoints are bound to.

A LoRA checkpoint holds the adapters and their optimizer state only; the frozen base is rebuilt at
resume from where the run took it, so the checkpoint records which base that was:

    model.from_hf / train.init_from = a Hugging Face directory:
        SHA-256 over config.json and every *.safetensors file (sorted by name, name + bytes)
    train.init_from = a Loom checkpoint:  SHA-256 of its manifest.json (which holds the SHA-256
        of every file of the checkpoint)
    neither (the seeded init):  SHA-256 of the model section and train.seed (canonical JSON)

Resuming, generating from or exporting (``--merge-lora``) a LoRA checkpoint against a base whose
hash differs is refused, naming both hashes (:func:`loom.checkpoint.training.check_base`, the one
rule). Generating and exporting read a base the config names by a relative path at the absolute
path the checkpoint recorded (it was relative to where the run trained: :func:`bind_base`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from loom.config import LoomConfig

CHUNK = 1 << 22


def _hash_files(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p.relative_to(root)).encode() + b"\0")
        with open(p, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()


def hf_dir_sha256(path: str | Path) -> str:
    """SHA-256 of a Hugging Face directory's config.json and safetensors files."""
    d = Path(path)
    return _hash_files([d / "config.json", *sorted(d.glob("*.safetensors"))], d)


def base_identity(cfg: LoomConfig) -> dict[str, str] | None:
    """{"kind", "path", "sha256"} of the base ``cfg`` fine-tunes (module docstring); None for a full
    fine-tune (its checkpoints hold every weight)."""
    if cfg.finetune.method == "full":
        return None
    src = cfg.train.init_from or cfg.model.from_hf
    if src and (Path(src) / "config.json").is_file():
        return {"kind": "hf", "path": str(Path(src).resolve()), "sha256": hf_dir_sha256(src)}
    if src:
        from loom.checkpoint.format import MANIFEST
        from loom.checkpoint.load import find

        found = find(src)
        ckpt = Path(found[0]) if found else Path(src)
        return {
            "kind": "checkpoint",
            "path": str(ckpt.resolve()),
            "sha256": hashlib.sha256((ckpt / MANIFEST).read_bytes()).hexdigest(),
        }
    record = json.dumps({"model": asdict(cfg.model), "seed": cfg.train.seed}, sort_keys=True)
    return {
        "kind": "init",
        "path": f"seeded init (train.seed = {cfg.train.seed})",
        "sha256": hashlib.sha256(record.encode()).hexdigest(),
    }


def bind_base(cfg: LoomConfig, recorded: dict | None, ckpt: Path | str, todo: str) -> None:
    """Point ``cfg`` at the base a LoRA checkpoint ``recorded`` (its ``finetune_base``): a relative
    ``train.init_from`` / ``model.from_hf`` was relative to where the run trained, so it becomes the
    absolute path the checkpoint recorded (an absolute one stays: the user may have moved the base and
    said so); then refuse a base whose SHA-256 differs (:func:`~loom.checkpoint.training.check_base`).
    ``todo``: what the refusal tells the user to do instead."""
    from loom.checkpoint.training import check_base

    if recorded is None:
        return
    field = "init_from" if cfg.train.init_from else "from_hf"
    section = cfg.train if field == "init_from" else cfg.model
    given = getattr(section, field)
    if recorded.get("kind") in ("hf", "checkpoint") and given and not Path(given).expanduser().is_absolute():
        setattr(section, field, str(recorded.get("path", given)))
    where = getattr(section, field)
    if recorded.get("kind") in ("hf", "checkpoint") and where and not Path(where).expanduser().exists():
        from loom.checkpoint.format import CheckpointError

        prefix = "train" if field == "init_from" else "model"
        raise CheckpointError(
            f"{prefix}.{field}: {where}: no such directory: the LoRA base {ckpt} was trained on "
            f"({recorded.get('kind')}, sha256 {str(recorded.get('sha256', '?'))[:12]}) is gone; "
            f"give --{prefix}.{field} where it is now"
        )
    check_base(recorded, base_identity(cfg), ckpt, cfg.finetune.method, todo)
