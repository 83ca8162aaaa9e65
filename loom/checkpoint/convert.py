"""Export a consolidated single-file model from a checkpoint saved under any layout.

``loom checkpoint convert RUN_OR_CKPT OUT.safetensors`` reads every ``model.*`` tensor whole
(from however many shards hold its pieces) and writes them, under the reference model's
parameter names, as one safetensors file: the format ``loom generate`` and
:func:`loom.train.export.load_model` read. Optimizer state is left out.
"""

from __future__ import annotations

import os
from pathlib import Path

from loom.checkpoint.format import CheckpointError, fsync_dir, write_safetensors
from loom.checkpoint.load import CheckpointReader

PREFIX = "model."


def convert(source: str | Path, out: str | Path, check: bool = True) -> tuple[Path, int, int]:
    """Write the consolidated model of ``source``; returns (checkpoint dir, step, tensor count).

    ``check=False`` skips the manifest verification (for a checkpoint this process just wrote).
    """
    out = Path(out)
    with CheckpointReader(source, check=check) as reader:
        if reader.dir.resolve() in out.resolve().parents:
            raise CheckpointError(
                f"{out}: inside the checkpoint it is converted from ({reader.dir}); write it "
                "elsewhere (a checkpoint's files are never replaced)"
            )
        names = [n for n in reader.names() if n.startswith(PREFIX)]
        if not names:
            raise CheckpointError(f"{reader.dir}: has no model.* tensors")
        tensors = {n[len(PREFIX) :]: reader.read(n) for n in names}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        write_safetensors(tmp, tensors, {"step": str(reader.step), "source": reader.dir.name})
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return reader.dir, reader.step, len(tensors)


def main(argv: list[str]) -> int:
    """``loom checkpoint convert RUN_OR_CKPT OUT.safetensors``."""
    if len(argv) != 3 or argv[0] != "convert":
        raise CheckpointError("usage: loom checkpoint convert RUN_DIR_OR_CHECKPOINT OUT.safetensors")
    ckpt, step, n = convert(argv[1], argv[2])
    print(f"wrote {argv[2]}: {n} tensors from {ckpt} (step {step})")
    return 0
