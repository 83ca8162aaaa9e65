"""Consolidated model weights as a single safetensors file (never pickle).

Tied parameters are stored once, under their first name; loading restores the tie.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loom.checkpoint.format import MODEL_FILE_METADATA, write_bytes_atomic


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, each shared tensor once (first name wins)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or name not in model.state_dict():
            continue
        seen.add(id(t))
        out[name] = t.detach().to("cpu").contiguous()
    return out


def save_model(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically: a temp file in the same directory, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(unique_state(model), str(tmp), metadata=MODEL_FILE_METADATA | (metadata or {}))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_model(model: nn.Module, path: str | Path) -> None:
    """Load weights saved by :func:`save_model`; every parameter must be covered."""
    state = load_file(str(path))
    missing = [k for k in unique_state(model) if k not in state]
    unexpected = [k for k in state if k not in model.state_dict()]
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        live = dict(model.named_parameters()) | dict(model.named_buffers())
        for k, v in state.items():
            if live[k].shape != v.shape:
                raise ValueError(
                    f"{path}: {k} has shape {tuple(v.shape)}, model expects {tuple(live[k].shape)}"
                )
            live[k].copy_(v)


def write_json_atomic(path: str | Path, obj: object) -> None:
    """``obj`` as indented JSON, atomically (:func:`~loom.checkpoint.format.write_bytes_atomic`)."""
    write_bytes_atomic(Path(path), json.dumps(obj, indent=2, sort_keys=True).encode())
