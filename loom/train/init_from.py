"""``train.init_from``: start a run from another run's weights (a Loom checkpoint of any layout, or a
local Hugging Face directory), with a fresh optimizer at step 0.

Unlike ``train.resume``, which continues a run exactly (optimizer, data position, RNG), this takes
weights only, so data, layout, optimizer and schedule may all differ. A checkpoint found in
``run.dir`` still wins: a restarted run resumes where it stopped instead of starting over.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig

PREFIX = "model."


@torch.no_grad()
def load_initial_weights(model: nn.Module, path: str | Path) -> str:
    """Copy the weights at ``path`` into the full (not yet parallelized) ``model``; returns what was read.
    A tensor missing from the source, or of another shape, is a one-line error naming it."""
    p = Path(path)
    if (p / "config.json").is_file():
        from loom.model.hf import expected_shapes, load_into, open_dir

        cfg = cast(ModelConfig, model.cfg)  # a Transformer's
        hf = open_dir(p, cfg.max_seq_len)
        mine = expected_shapes(cfg)
        theirs = expected_shapes(hf.config)
        for name, shape in mine.items():
            if theirs.get(name) != shape:
                raise ConfigError(
                    f"train.init_from: {p} holds {name} of shape {theirs.get(name)}, this model "
                    f"has {shape} (give the same model fields, or use model.from_hf)"
                )
        load_into(model, hf)
        return f"Hugging Face model {p}"
    from loom.checkpoint.load import CheckpointReader

    with CheckpointReader(p) as reader:
        have = set(reader.names())
        for name, param in model.named_parameters():
            key = PREFIX + name
            if key not in have:
                raise ConfigError(f"train.init_from: {reader.dir} has no tensor {key}")
            if tuple(reader.global_shape(key)) != tuple(param.shape):
                raise ConfigError(
                    f"train.init_from: {key} has shape {tuple(reader.global_shape(key))} in "
                    f"{reader.dir}, this model has {tuple(param.shape)}"
                )
            param.copy_(reader.read(key))
        return f"checkpoint {reader.dir} (step {reader.step})"
