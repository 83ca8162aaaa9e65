"""The base a LoRA run fine-tunes, by path and SHA-256: what its checkpoints are bound to.

A LoRA checkpoint holds the adapters and their optimizer state only; the frozen base is rebuilt at
resume from where the run took it, so the checkpoint records which base that was:

    model.from_hf / train.init_from = a Hugging Face directory:
        SHA-256 over config.json and every *.safetensors file (sorted by name, name + bytes)
    train.init_from = a Loom checkpoint:  SHA-256 of its manifest.json (which holds the SHA-256
        of every file of the checkpoint)
    neither (the seeded init):  SHA-256 of the model section and train.seed (canonical JSON)

Resuming against a base whose hash differs is refused, naming both hashes.
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
