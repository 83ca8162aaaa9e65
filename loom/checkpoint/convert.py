"""Export a consolidated single-file model from a checkpoint saved under any layout.

``loom checkpoint convert RUN_OR_CKPT OUT.safetensors`` writes every ``model.*`` tensor (from
however many shards hold its pieces), under the reference model's parameter names, as one
safetensors file: the format ``loom generate`` and :func:`loom.train.export.load_model` read.
Optimizer state is left out.

Streamed: the header is built from the index alone (names, shapes, dtypes), then each tensor's
bytes are read and written a block of whole rows at a time (at most ``buffer_bytes``, or one row
if a row is larger), so the host holds one block plus the checkpoint slice it is copied from:

    peak tensor bytes ≤ 2 · max(buffer_bytes, largest row),

not the model (1.6 TB for a 405B model in fp32). The file is byte for byte what writing all the
tensors at once (:func:`loom.checkpoint.format.write_safetensors`) gives.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from loom.checkpoint.format import (
    DTYPES,
    MODEL_FILE_METADATA,
    CheckpointError,
    check_outside_checkpoints,
    staged,
)
from loom.checkpoint.load import CheckpointReader
from loom.checkpoint.protocol import Box
from loom.config import check_new_output

PREFIX = "model."
BUFFER_BYTES = 256 << 20  # tensor bytes read and written at a time


def _header(reader: CheckpointReader, names: list[str], metadata: dict[str, str]) -> bytes:
    """8-byte little-endian length + the JSON header padded with spaces to a multiple of 8, tensors
    in sorted order back to back (the layout :func:`~loom.checkpoint.format.write_safetensors` writes)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        shape, dtype = reader.global_shape(PREFIX + name), reader.dtype(PREFIX + name)
        nbytes = _numel(shape) * dtype.itemsize
        header[name] = {
            "dtype": DTYPES[dtype][1],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_tensor(fh, reader: CheckpointReader, name: str, buffer_bytes: int) -> None:
    """``name``'s bytes in row-major order, blocks of whole rows of dim 0 (a 0-d tensor whole)."""
    shape, dtype = reader.global_shape(name), reader.dtype(name)
    if not shape:
        blocks: list[Box | None] = [None]
    else:
        rows = max(1, buffer_bytes // max(1, _numel(shape[1:]) * dtype.itemsize))
        zeros = (0,) * (len(shape) - 1)
        blocks = [
            Box((lo, *zeros), (min(rows, shape[0] - lo), *shape[1:])) for lo in range(0, shape[0], rows)
        ]
    for box in blocks:
        block = reader.read(name, box)  # (rows, *shape[1:]), assembled from the pieces holding them
        if block.numel():
            fh.write(block.reshape(-1).view(torch.uint8).numpy().data)
        del block


def convert(
    source: str | Path,
    out: str | Path,
    check: bool = True,
    buffer_bytes: int = BUFFER_BYTES,
    replace: bool = False,
) -> tuple[Path, int, int]:
    """Write the consolidated model of ``source``; returns (checkpoint dir, step, tensor count).

    ``check=False`` skips the manifest verification (for a checkpoint this process just wrote);
    ``buffer_bytes``: the tensor bytes held at a time (module doc); ``replace``: an existing ``out``
    is replaced (the trainer's own final model), else refused before anything is written.
    """
    out = Path(out)
    if buffer_bytes < 1:
        raise CheckpointError(f"buffer_bytes: must be >= 1, got {buffer_bytes}")
    with CheckpointReader(source, check=check) as reader:
        if reader.dir.resolve() in out.resolve().parents:
            raise CheckpointError(
                f"{out}: inside the checkpoint it is converted from ({reader.dir}); write it "
                "elsewhere (a checkpoint's files are never replaced)"
            )
        if not replace:
            check_new_output(out, directory=False, error=CheckpointError)
            check_outside_checkpoints(out, "the consolidated file")
        base = reader.train_state.get("finetune_base")
        if base:  # its model.* tensors are the adapters: a "consolidated model" of them would be no model
            raise CheckpointError(
                f"{reader.dir}: holds LoRA adapters only (on the base {base.get('path', '?')}); the run's "
                "checkpoints/final/model.safetensors is its merged model, `loom export hf RUN OUT --merge-lora` "
                "writes one for Hugging Face, `loom export peft` the adapters"
            )
        names = sorted(n[len(PREFIX) :] for n in reader.names() if n.startswith(PREFIX))
        if not names:
            raise CheckpointError(f"{reader.dir}: has no model.* tensors")
        with staged(out) as tmp, open(tmp, "wb") as fh:  # a new hidden name: no user file is touched
            meta = MODEL_FILE_METADATA | {"step": str(reader.step), "source": reader.dir.name}
            fh.write(_header(reader, names, meta))
            for n in names:
                _write_tensor(fh, reader, PREFIX + n, buffer_bytes)
            fh.flush()
            os.fsync(fh.fileno())
        return reader.dir, reader.step, len(names)


def main(argv: list[str]) -> int:
    """``loom checkpoint convert RUN_OR_CKPT OUT.safetensors``."""
    if len(argv) != 3 or argv[0] != "convert":
        raise CheckpointError("usage: loom checkpoint convert RUN_DIR_OR_CHECKPOINT OUT.safetensors")
    if Path(argv[2]).suffix != ".safetensors":  # a .bin or .pt is read as a pickle by other tools
        raise CheckpointError(
            f"checkpoint convert: {argv[2]}: the output is a safetensors file; name it *.safetensors"
        )
    ckpt, step, n = convert(argv[1], argv[2])
    print(f"wrote {argv[2]}: {n} tensors from {ckpt} (step {step})")
    return 0
