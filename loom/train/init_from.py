"""``train.init_from``: start a run from another run's weights (a Loom checkpoint of any layout, or a
local Hugging Face directory), with a fresh optimizer at step 0.

Unlike ``train.resume``, which continues a run exactly (optimizer, data position, RNG), this takes
weights only, so data, layout, optimizer and schedule may all differ. A checkpoint found in
``run.dir`` still wins: a restarted run resumes where it stopped instead of starting over.

The weights are a :data:`~loom.parallel.materialize.Source`, as ``model.from_hf``'s: the model is
built on the meta device and parallelized, then each rank materializes only what it holds, reading
only those boxes of the source's tensors (:mod:`loom.parallel.materialize`).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from torch import nn

from loom.checkpoint.format import CheckpointError
from loom.checkpoint.load import CheckpointReader
from loom.checkpoint.protocol import Box
from loom.config import ConfigError, LoomConfig, ModelConfig
from loom.parallel.materialize import Source

PREFIX = "model."


def initial_source(model: nn.Module, path: str | Path, check: bool = True) -> tuple[Source, str]:
    """The weights at ``path`` for ``model`` (built on the meta device or whole: only its parameters'
    names and shapes are read) as a source, and what it reads. A tensor missing from the source, or of
    another shape, is a one-line error naming it, before anything is read. ``check=False``: a
    checkpoint's files are not hashed (its manifest and index are still read)."""
    p = Path(path)
    if (p / "config.json").is_file():
        from loom.model.hf import HFError

        try:
            return _hf_source(model, p)
        except (HFError, KeyError) as e:  # a damaged directory, named as the field that gave it
            raise ConfigError(str(e) if isinstance(e, ConfigError) else f"train.init_from: {e}") from None
    ckpt = CheckpointSource(p, model, check)
    return ckpt, f"checkpoint {ckpt.reader.dir} (step {ckpt.reader.step})"


def _hf_source(model: nn.Module, p: Path) -> tuple[Source, str]:
    """A Hugging Face directory's weights for ``model``: every tensor there, of this model's shape."""
    from loom.model.hf import expected_shapes, open_dir, source

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
    extra = sorted(theirs.keys() - mine.keys())
    if extra:  # weights this model would drop (biases, q/k norms, an untied head)
        raise ConfigError(
            f"train.init_from: {p} holds {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, "
            "which this model lacks (give the same model fields, or use model.from_hf)"
        )
    _check_same_math(cfg, hf.config, p)
    return source(hf), f"Hugging Face model {p}"


def _check_same_math(mine: ModelConfig, theirs: ModelConfig, path: Path) -> None:
    """The fields of a Hugging Face ``config.json`` that change what its weights compute without
    changing their shapes (RoPE base and scaling, norm epsilon and kind, norm placement, routing's
    top-k) equal this model's: otherwise the run silently trains another model from them."""
    from loom.model.hf import DERIVED, HF_FIELDS

    for field in HF_FIELDS:
        if field in ("max_seq_len", "hf_architecture", "vocab_size", *DERIVED):  # reach, naming, shapes
            continue
        a, b = getattr(mine, field), getattr(theirs, field)
        unused = (field == "top_k" and not theirs.moe) or field in theirs.rope_idle_fields()
        if a != b and not unused:
            raise ConfigError(
                f"train.init_from: {path / 'config.json'} gives {field} = {b!r}, this model has "
                f"model.{field} = {a!r} (give the same model fields, or use model.from_hf)"
            )


def check_init_from(cfg: LoomConfig, tokenizer_vocab: int) -> None:
    """``train.init_from`` checked by the launcher before any rank starts, as each rank will open it:
    every parameter of the model this config builds (on the meta device: no memory) is there, of its
    shape; a Hugging Face directory's headers and a checkpoint's manifest and index are read, the
    checkpoint's content is hashed by the ranks."""
    import copy

    from loom.config import effective_vocab
    from loom.model.llama import build_model

    c = copy.deepcopy(cfg)
    c.model.vocab_size = effective_vocab(c, tokenizer_vocab)
    model = build_model(c.model, c.train.seed, meta=True, moe=c.moe)
    source, _ = initial_source(model, cfg.train.init_from, check=False)
    if isinstance(source, CheckpointSource):
        source.reader.close()


class CheckpointSource:
    """The source of a Loom checkpoint's model weights: ``(name, shape, index)`` -> that box of
    ``model.<name>``, read from whatever files hold it (the checkpoint verified once, when opened)."""

    def __init__(self, path: Path, model: nn.Module, check: bool = True) -> None:
        try:
            self.reader = CheckpointReader(path, check=check)
        except CheckpointError as e:
            said = str(e)
            if "holds no checkpoint" in said:  # not a damaged checkpoint: another kind of directory
                kind = (
                    " (a PEFT adapter: merge it into its base first)"
                    if (path / "adapter_config.json").is_file()
                    else " (give a run directory, one of its checkpoints, or a Hugging Face model directory)"
                )
                final = (path / "model.safetensors").is_file() and (path / "meta.json").is_file()
                said = said if final else f"{path}: holds no checkpoint{kind}"  # a run's final model: as said
            raise ConfigError(f"train.init_from: {said}") from None
        saved = int(((self.reader.train_state.get("config") or {}).get("model") or {}).get("vocab_size") or 0)
        vocab = int(getattr(getattr(model, "cfg", None), "vocab_size", 0) or 0)
        if saved and vocab and saved != vocab:  # padding may differ (resized), the token ids may not
            raise ConfigError(
                f"train.init_from: {self.reader.dir} was trained with a vocabulary of {saved:,} tokens, "
                f"this run's has {vocab:,} (another tokenizer: its rows would be other tokens' vectors); "
                "give data.tokenizer the tokenizer.json of the run it comes from"
            )
        base = self.reader.train_state.get("finetune_base")
        if base and not any(n.startswith(PREFIX) and "lora_" not in n for n in self.reader.names()):
            raise ConfigError(
                f"train.init_from: {self.reader.dir} is a LoRA run's checkpoint, its adapters only (on the "
                f"base {base.get('path', '?')}); start from the merged model it exports (loom export hf "
                "RUN OUT --merge-lora, then model.from_hf or train.init_from OUT)"
            )
        have = set(self.reader.names())
        for name, param in model.named_parameters():
            key = PREFIX + name
            if key not in have:
                raise ConfigError(f"train.init_from: {self.reader.dir} has no tensor {key}")
            if tuple(self.reader.global_shape(key)) != tuple(param.shape) and not self.reader.resized(
                key, tuple(param.shape)
            ):
                raise ConfigError(
                    f"train.init_from: {key} has shape {tuple(self.reader.global_shape(key))} in "
                    f"{self.reader.dir}, this model has {tuple(param.shape)}"
                )

    def __call__(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        box = Box(tuple(s.start for s in index), tuple(s.stop - s.start for s in index))
        return self.reader.read(PREFIX + name, box, shape)  # a padded vocabulary: any padded rows
