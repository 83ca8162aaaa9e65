"""A LoRA run out of Loom: PEFT adapters, merged Hugging Face weights, or a merged Loom model.

``loom export peft RUN_OR_CHECKPOINT OUT_DIR`` writes what ``peft.PeftModel.from_pretrained`` loads
onto the Hugging Face export of the base (``adapter_config.json`` + ``adapter_model.safetensors``),
under PEFT's names::

    layers.i.attention.w{q,k,v,o}.lora_{A,B}.weight    base_model.model.model.layers.i.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    layers.i.feed_forward.w{1,3,2}.lora_{A,B}.weight   base_model.model.model.layers.i.mlp.{gate,up,down}_proj.lora_{A,B}.weight

q and k's B rows are reordered as their weights' (Hugging Face rotates head halves, Loom pairs:
:func:`loom.model.hf.to_hf_rows`); A is unchanged. A fused HF tensor of n parts (GPT-2's
``c_attn`` and Phi-3's ``qkv_proj``: q, k, v; Phi-3's ``gate_up_proj``: w1, w3) gets one adapter
A = [A_1; ...; A_n] (rank n·r) and B = diag(B_1, ..., B_n) (each B_j at its part's rows, zero
blocks for a part not targeted), with ``rank_pattern``/``alpha_pattern`` n·r and n·α so its scale
stays α/r: the same function. GPT-2's Conv1D layers need ``fan_in_fan_out``.

``loom export hf RUN OUT_DIR --merge-lora``: the base's tensors (from ``model.from_hf``,
``train.init_from`` or the seeded init, read one at a time) with W + (α/r)·B A on every target,
written as :mod:`loom.checkpoint.hf_export` writes any checkpoint. QLoRA trained on the NF4 form
of each target, so its merge is Ŵ + (α/r)·B A with Ŵ = dequantize(quantize(W)) in the run's
parameter dtype (:func:`loom.finetune.nf4.as_trained`): the model the run evaluated, not W's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from loom import config as C
from loom.checkpoint.format import (
    MODEL_FILE_METADATA,
    CheckpointError,
    check_outside_checkpoints,
    staged,
    umask_mode,
)
from loom.checkpoint.hf_export import export_hf, pop_dtype, pop_shard_size
from loom.checkpoint.load import CheckpointReader
from loom.device import DTYPES, resolve_precision
from loom.finetune.base import bind_base
from loom.finetune.lora import LORA_SUFFIXES, merged_weight
from loom.finetune.nf4 import as_trained
from loom.model.hf import VOCAB_TENSORS, _mappings, architecture_of, to_hf_rows
from loom.numbers import is_whole

PREFIX = "model."
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def lora_config_of(reader: CheckpointReader, what: str) -> C.LoomConfig:
    """The config a checkpoint was saved with; a full fine-tune's is a one-line error naming ``what``."""
    saved = reader.train_state.get("config")
    if not saved:
        raise CheckpointError(
            f"{reader.dir}: has no saved config (train_state.json); cannot describe the model"
        )
    cfg = C.from_dict(saved)
    if cfg.finetune.method == "full":
        raise CheckpointError(
            f"{what}: {reader.dir} is not a LoRA run (finetune.method = full: it holds every "
            "weight); export it with `loom export hf`"
        )
    return cfg


def adapters(reader: CheckpointReader) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base weight name -> (A, B) of every adapter in the checkpoint."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in reader.names():
        if name.startswith(PREFIX) and name.endswith(LORA_SUFFIXES[0]):
            module = name[len(PREFIX) : -len(LORA_SUFFIXES[0])]
            out[module + ".weight"] = (reader.read(name), reader.read(PREFIX + module + LORA_SUFFIXES[1]))
    return out


def peft_state(cfg: C.LoomConfig, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, dict]:
    """(PEFT tensors by name, adapter_config.json) of Loom's adapters (module docstring)."""
    maps = dict(_mappings(cfg.model))
    f = cfg.finetune
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # module -> row offset -> (A, B)
    layout: dict[str, tuple[list[int], int]] = {}  # fused module -> (its parts' row offsets, its rows)
    for m in maps.values():
        if m.part is not None and str(m.hf).endswith(".weight"):
            layout.setdefault(str(m.hf).removesuffix(".weight"), ([], m.part[1]))[0].append(m.part[0])
    targets: set[str] = set()
    for name, (a, b) in pairs.items():
        m = maps[name]
        module = str(m.hf).removesuffix(".weight")
        targets.add(_suffix(module))
        if m.heads:
            b = to_hf_rows(b, m.heads, m.rotary)
        if m.part is not None:  # one part of a fused tensor: its adapter joins the others'
            fused.setdefault(module, {})[m.part[0]] = (a, b)
            continue
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    rank_pattern, alpha_pattern = {}, {}
    for module, parts in fused.items():
        r, (starts, rows) = f.lora_rank, layout[module]
        n = len(starts)
        a_cat = torch.zeros(n * r, next(iter(parts.values()))[0].shape[1])
        b_cat = torch.zeros(rows, n * r)
        for j, start in enumerate(starts):
            if start in parts:
                a, b = parts[start]
                a_cat[j * r : (j + 1) * r] = a
                b_cat[start : start + b.shape[0], j * r : (j + 1) * r] = b
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a_cat
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_cat
        rank_pattern[_suffix(module)], alpha_pattern[_suffix(module)] = n * r, n * f.lora_alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": f.lora_rank,
        "lora_alpha": f.lora_alpha,
        "lora_dropout": f.lora_dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": architecture_of(cfg.model) == "GPT2LMHeadModel",
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": None,
        "base_model_name_or_path": _hf_base(cfg),
    }
    return tensors, config


def _hf_base(cfg: C.LoomConfig) -> str | None:
    """The Hugging Face directory the adapters apply to (``AutoPeftModelForCausalLM`` loads it): the
    run's ``model.from_hf``, or a ``train.init_from`` that is one (holds a config.json); None for a
    base of Loom's own (give ``PeftModel.from_pretrained`` its ``loom export hf``)."""
    if cfg.model.from_hf:
        return cfg.model.from_hf
    src = cfg.train.init_from
    return (
        str(Path(src).expanduser().absolute())
        if src and (Path(src).expanduser() / "config.json").is_file()
        else None
    )


def _suffix(module: str) -> str:
    """The module's name below its block (``self_attn.q_proj``, ``attn.c_attn``): a PEFT target."""
    parts = module.split(".")
    i = next(k for k, p in enumerate(parts) if is_whole(p))
    return ".".join(parts[i + 1 :])


def export_peft(source: str | Path, out: str | Path) -> Path:
    """Write the PEFT adapter directory ``out`` for the LoRA checkpoint ``source``."""
    from safetensors.torch import save_file

    out = Path(out)
    C.check_new_output(out, directory=True, error=CheckpointError)
    check_outside_checkpoints(out, "the adapter directory")
    with CheckpointReader(source) as reader:
        cfg = lora_config_of(reader, "export peft")
        tensors, config = peft_state(cfg, adapters(reader))
    with staged(out, directory=True) as tmp:  # a new hidden directory: nothing there is adopted
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata=MODEL_FILE_METADATA)
        umask_mode(tmp / ADAPTER_WEIGHTS)  # as `loom export hf` writes its shards
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def base_tensors(cfg: C.LoomConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Loom name, whole tensor) of the base a LoRA run fine-tuned, one at a time (each tied tensor once):
    from ``train.init_from`` or ``model.from_hf``, else the seeded init."""
    from loom.model.llama import build_model, init_value

    meta = build_model(cfg.model, cfg.train.seed, meta=True, moe=cfg.moe)
    seen: set[int] = set()
    names = []
    for name, p in meta.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            names.append((name, tuple(p.shape)))
    src = cfg.train.init_from or cfg.model.from_hf
    if src and (Path(src) / "config.json").is_file():
        from loom.model.hf import open_dir, read_state

        yield from read_state(open_dir(src, cfg.model.max_seq_len), {n for n, _ in names})
        return
    if src:
        with CheckpointReader(src) as reader:
            for name, _ in names:
                yield name, reader.read(PREFIX + name)
        return
    for name, shape in names:
        yield name, init_value(cfg.model, cfg.train.seed, name, shape)


class MergedReader:
    """A checkpoint reader's interface (names, dtype, global_shape, read) over the merged model of a
    LoRA checkpoint: W + (α/r)·B A for every target, the base's other tensors as they are."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.cfg = lora_config_of(reader, "export hf --merge-lora")
        bind_base(  # the recorded absolute path, and the SHA-256 the run trained on
            self.cfg,
            reader.train_state.get("finetune_base"),
            reader.dir,
            "merge onto the base it was trained on",
        )
        self.pairs = adapters(reader)
        self.scale = self.cfg.finetune.lora_alpha / self.cfg.finetune.lora_rank
        # QLoRA: the targets' weights as the run used them (NF4 from its parameter dtype), else W itself
        self.nf4 = (
            DTYPES[resolve_precision(self.cfg.train.precision, self.cfg.run.device)]
            if self.cfg.finetune.method == "qlora"
            else None
        )
        self.base = {n: t for n, t in base_tensors(self.cfg)}  # noqa: C416 - read once, in order
        self.dir, self.step, self.train_state = reader.dir, reader.step, reader.train_state

    def names(self) -> list[str]:
        return [PREFIX + n for n in self.base]

    def dtype(self, name: str) -> torch.dtype:
        return self.base[name[len(PREFIX) :]].dtype

    def global_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.base[name[len(PREFIX) :]].shape)
        return (self._rows(name[len(PREFIX) :], shape[0]), *shape[1:])

    def _rows(self, name: str, rows: int) -> int:
        """A vocabulary tensor's rows as the run's model holds them: V' (``model.pad_vocab_to``, a
        run padded for tp) where the base has V, like a full run's checkpoint; others as they are."""
        return max(rows, self.cfg.model.padded_vocab) if name in VOCAB_TENSORS else rows

    def read(self, name: str) -> torch.Tensor:
        name = name[len(PREFIX) :]
        w = self.base[name]
        if name in self.pairs:
            a, b = self.pairs[name]
            used = w if self.nf4 is None else as_trained(w, self.nf4)
            w = merged_weight(used, a, b, self.scale).to(w.dtype)
        rows = self._rows(name, w.shape[0])
        return w if rows == w.shape[0] else torch.cat((w, w.new_zeros(rows - w.shape[0], *w.shape[1:])))


def merged_state(source: str | Path) -> tuple[C.LoomConfig, dict[str, torch.Tensor]]:
    """(the run's config with method = full, Loom name -> merged tensor) of a LoRA checkpoint: what
    ``loom generate`` loads into a plain :class:`~loom.model.llama.Transformer`."""
    with CheckpointReader(source) as reader:
        merged = MergedReader(reader)
        state = {n[len(PREFIX) :]: merged.read(n) for n in merged.names()}
        cfg = merged.cfg
    cfg.finetune = C.FinetuneConfig()
    return cfg, state


def main(argv: list[str]) -> int:
    """``loom export peft RUN OUT`` and ``loom export hf RUN OUT --merge-lora [--max-shard-size 5GB]
    [--dtype bf16|fp16|fp32]``."""
    args = [a for a in argv if a != "--merge-lora"]
    if args[:1] == ["peft"]:  # one adapter file in the run's own dtype: these options would do nothing
        for option, why in (
            ("--max-shard-size", "writes one adapter file, never sharded"),
            ("--dtype", "writes the adapters as the checkpoint stores them"),
        ):
            if option in args:
                raise CheckpointError(
                    f"{option}: not an option of `loom export peft` (it {why}); it is for "
                    "`loom export hf --merge-lora`"
                )
    size = pop_shard_size(args)
    dtype = pop_dtype(args)
    if len(args) != 3 or args[0] not in ("hf", "peft") or (args[0] == "peft") == ("--merge-lora" in argv):
        raise CheckpointError(
            "usage: loom export peft RUN_DIR_OR_CHECKPOINT OUT_DIR | loom export hf RUN_DIR_OR_CHECKPOINT "
            "OUT_DIR --merge-lora [--max-shard-size 5GB] [--dtype bf16|fp16|fp32]"
        )
    if args[0] == "peft":
        out = export_peft(args[1], args[2])
        print(f"wrote {out}: {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}")
        return 0
    done = export_hf(args[1], args[2], size, progress=True, wrap=MergedReader, dtype=dtype)
    print(
        f"wrote {done.out}: {done.tensors} tensors (LoRA merged) in {done.shards} shard(s), "
        f"{done.total_bytes / 1e6:.1f} MB, from {done.checkpoint} (step {done.step})"
    )
    return 0


def save_merged(source: str | Path, path: str | Path) -> None:
    """The merged model of a LoRA checkpoint as one safetensors file of Loom names (what a full run's
    ``checkpoints/final/model.safetensors`` holds, for ``loom generate``); written atomically. Its
    header names the checkpoint (``source``: its tag, ``step``) and says ``lora = merged``, so
    :func:`loom.generate.source.verify_final` can recompute the merge from that verified checkpoint
    and the base it records, and refuse a file that differs."""
    from safetensors.torch import save_file

    with CheckpointReader(source) as reader:
        tag, step = reader.dir.name, reader.step
    _, state = merged_state(source)
    meta = MODEL_FILE_METADATA | {"lora": "merged", "source": tag, "step": str(step)}
    with staged(Path(path)) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=meta)
        umask_mode(tmp)
