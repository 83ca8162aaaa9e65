"""``loom export hf RUN_OR_CHECKPOINT OUT_DIR``: a Hugging Face model directory from a checkpoint of
any layout.

Writes ``config.json``, ``generation_config.json``, safetensors shards of at most
``max_shard_bytes`` with ``model.safetensors.index.json``, and the run's tokenizer. Tensors are
streamed one at a time from the checkpoint reader (which assembles ZeRO, tensor and pipeline
pieces), so peak memory is one output shard plus the largest tensor. The directory is built
under a new hidden name beside ``OUT_DIR`` (:func:`~loom.checkpoint.format.staged`) and renamed into place when complete;
an existing file or non-empty ``OUT_DIR`` is never touched. Files get the umask's mode (0644 under
the usual 022).

A run from a Hugging Face directory (``model.from_hf`` or ``train.init_from``) keeps what that
directory says beyond the tensors: its ``config.json`` fields (architecture, e.g. Mistral with its
``sliding_window``; ``max_position_embeddings``, not the training ``seq_len``; BOS/EOS/pad ids;
RoPE scaling), provided its shapes are the exported model's; its ``generation_config.json``; and
its tokenizer's ``tokenizer_config.json`` (pad and special tokens, ``model_max_length``, an inline
chat template), ``special_tokens_map.json`` and ``chat_template.jinja``. Weights are written in
``dtype`` (``bf16``, ``fp16``, ``fp32``; default: the source's dtype: the HF directory's
``dtype``/``torch_dtype``, else the checkpoint's).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loom import config as C
from loom.checkpoint.format import (
    CheckpointError,
    check_outside_checkpoints,
    check_run_tokenizer,
    staged,
    umask_mode,
)
from loom.checkpoint.load import CheckpointReader
from loom.model.hf import (
    INDEX,
    VOCAB_TENSORS,
    architecture,
    architecture_of,
    hf_config,
    hf_tensors,
    hf_units,
    model_config,
    moe_export_problem,
)
from loom.numbers import is_whole

PREFIX = "model."
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# config.json fields that define the tensors: the source's are carried over only if all of these agree
SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "vocab_size",
    "tie_word_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
)
# loom.data.chat.builtin_render as Jinja (tests check they agree), with its generation prompt
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SAME_TENSORS = {"MistralForCausalLM": "LlamaForCausalLM"}  # a source family stored as Loom's family


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


def source_dir(cfg: C.LoomConfig) -> Path | None:
    """The Hugging Face directory a run started from (``train.init_from`` or ``model.from_hf``), if any."""
    for src in (cfg.train.init_from, cfg.model.from_hf):
        if src and (Path(src) / "config.json").is_file():
            return Path(src)
    return None


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e}); nothing was written") from None
    return out if isinstance(out, dict) else {}


# the ModelConfig fields (as model_config reads a config.json) that fix the tensors' names and shapes
SHAPE = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "vocab_size",
    "tie_embeddings",
    "n_experts",
)


def _same_tensors(raw: dict, ours: dict) -> bool:
    """Both ``config.json`` describe the same tensors: compared as Loom reads them, so a field the
    source leaves to its default (GPT-2's ``"n_inner": null`` = 4·n_embd) equals its value; by the
    raw SHAPE_FIELDS where the source is not one Loom reads."""
    try:
        a, b = model_config(raw, fit_window=True), model_config(ours, fit_window=True)
    except (ValueError, KeyError, TypeError):
        return not any(f in raw and f in ours and raw[f] != ours[f] for f in SHAPE_FIELDS)
    return all(getattr(a, f) == getattr(b, f) for f in SHAPE)


def carried_config(ours: dict, src: Path | None) -> dict:
    """``config.json``: Loom's description ``ours`` with every field of the source directory's
    ``config.json`` carried over when the source describes the same tensors (module doc)."""
    if src is None:
        return ours
    raw = _read_json(src / "config.json")
    arch, mine = architecture(raw), ours["architectures"][0]
    if SAME_TENSORS.get(arch, arch) != SAME_TENSORS.get(mine, mine) or not _same_tensors(raw, ours):
        return ours  # the model changed shape or family since: describe what was trained
    kept = {k: v for k, v in raw.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    return ours | kept | {"dtype": ours["dtype"]}


def _tokenizer_files(run_dir: Path, cfg: C.LoomConfig, tmp: Path, config: dict) -> dict[str, Any]:
    """Copy the run's ``tokenizer.json`` and the files describing it for ``AutoTokenizer`` (its source
    directory's, else a ``tokenizer_config.json`` of Loom's tokenizer); returns the special ids for
    ``config.json`` (the source's where it gives them)."""
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
    tok_dir = Path(cfg.data.tokenizer).expanduser() if cfg.data.tokenizer else None
    tok_dir = tok_dir if tok_dir is None or tok_dir.is_dir() else tok_dir.parent
    copied = False
    for d in (tok_dir, source_dir(cfg)):
        if d is not None and any((d / f).is_file() for f in TOKENIZER_FILES):
            for f in TOKENIZER_FILES:
                if (d / f).is_file():
                    shutil.copyfile(d / f, tmp / f)
            if (d / "chat_templates").is_dir():
                shutil.copytree(d / "chat_templates", tmp / "chat_templates")
            copied = True
            break
    tok = load_tokenizer(src)
    eot = eot_id(tok)
    if not copied:
        name = tok.id_to_token(eot)
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": name,  # Loom's tokenizer: <|endoftext|> opens and ends documents
                    "eos_token": name,
                    # and pads (masked by the attention mask): batched tokenizers and pipelines need one
                    "pad_token": name,
                    "model_max_length": cfg.model.max_seq_len,
                },
                indent=2,
            )
        )
    chat = cfg.data.format == "chat" or any(s.format == "chat" for s in cfg.data.sources)
    tcfg = tmp / "tokenizer_config.json"
    templated = (tmp / "chat_template.jinja").is_file() or (
        tcfg.is_file() and "chat_template" in _read_json(tcfg)
    )
    if chat and not templated:  # trained on Loom's built-in rendering: apply_chat_template gives it
        (tmp / "chat_template.jinja").write_text(BUILTIN_CHAT_TEMPLATE)
    special = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    }
    return special or {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}


def _export_dtype(requested: str | None, src: Path | None, stored: torch.dtype) -> torch.dtype:
    """The weights' dtype: ``requested`` (bf16, fp16, fp32), else the source directory's, else ``stored``."""
    if requested is not None:
        if requested not in DTYPES:
            raise CheckpointError(f"--dtype: {requested!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    if src is not None:
        raw = _read_json(src / "config.json")
        named = raw.get("dtype") or raw.get("torch_dtype")
        if named in HF_DTYPES:
            return HF_DTYPES[named]
    return stored


def export_hf(
    source: str | Path,
    out: str | Path,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = False,
    wrap: Callable[[CheckpointReader], Any] | None = None,
    dtype: str | None = None,
) -> Exported:
    """Write the Hugging Face directory ``out`` for the checkpoint ``source`` (see module doc).
    ``wrap``: what to read the tensors through instead of the checkpoint reader itself (a LoRA run's
    merged weights: :class:`loom.finetune.export.MergedReader`); ``dtype``: bf16, fp16 or fp32
    (None: the source's)."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out)
    C.check_new_output(out, directory=True, error=CheckpointError)
    check_outside_checkpoints(out, "the Hugging Face directory")
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
        check_run_tokenizer(opened.dir.parent.parent)  # the tokenizer it ships: before anything is written
        architecture_of(
            cfg.model
        )  # a model no Hugging Face family holds fails here, before anything is written
        if cfg.model.moe and (why := moe_export_problem(cfg.moe, architecture_of(cfg.model))) is not None:
            raise CheckpointError(
                f"{opened.dir}: cannot be exported to Hugging Face: {why} (nothing was written)"
            )
        names = [n[len(PREFIX) :] for n in reader.names() if n.startswith(PREFIX)]
        if not names:
            raise CheckpointError(f"{reader.dir}: has no model.* tensors")
        hf_src = source_dir(cfg)
        want = _export_dtype(dtype, hf_src, reader.dtype(PREFIX + names[0]))
        size = {
            n: want.itemsize * _numel(_hf_shape(cfg.model, n, reader.global_shape(PREFIX + n))) for n in names
        }
        units = hf_units(
            cfg.model, names
        )  # the Loom tensors of one HF tensor stay in one shard (GPT-2's c_attn)
        planned = plan_shards(
            [(str(i), sum(size[n] for n in unit)) for i, unit in enumerate(units)], max_shard_bytes
        )
        shards = [[n for i in group for n in units[int(i)]] for group in planned]
        with staged(out, directory=True) as tmp:  # an empty ``out`` (checked above) is replaced
            weight_map, total = _write_shards(tmp, reader, cfg.model, shards, want, progress)
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
            config = carried_config(
                hf_config(cfg.model, str(want).removeprefix("torch."), moe=cfg.moe), hf_src
            )
            special = _tokenizer_files(reader.dir.parent.parent, cfg, tmp, config)
            config |= special
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            if hf_src is not None and (hf_src / "generation_config.json").is_file():
                shutil.copyfile(hf_src / "generation_config.json", tmp / "generation_config.json")
            else:
                (tmp / "generation_config.json").write_text(json.dumps(special, indent=2))
        return Exported(out, reader.dir, reader.step, len(shards), len(weight_map), total)


def _write_shards(
    tmp: Path, reader: Any, m: C.ModelConfig, shards: list[list[str]], want: torch.dtype, progress: bool
) -> tuple[dict[str, str], int]:
    """Write the safetensors shards into ``tmp``; returns (HF tensor name -> file, total bytes)."""
    weight_map, total = {}, 0
    bar = _bar(sum(len(g) for g in shards), progress)
    for i, group in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        stream = ((n, _cast(reader.read(PREFIX + n), want)) for n in group)
        tensors = dict(hf_tensors(m, stream))
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        umask_mode(tmp / file)
        _fsync(tmp / file)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        bar.update(len(group))
        del tensors
    bar.close()
    return weight_map, total


def _hf_shape(m: C.ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The exported shape of Loom's tensor ``name``: a padded vocabulary's embedding and head keep
    their ``vocab_size`` real rows (:func:`loom.model.hf.hf_tensors`), so the export has the size the
    model was given (the source directory's ``vocab_size``)."""
    return (min(shape[0], m.vocab_size), *shape[1:]) if name in VOCAB_TENSORS else shape


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating-point tensors in the export's dtype; others (integer buffers) as they are."""
    return t.to(dtype) if t.is_floating_point() else t


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
        if t.endswith(unit) and is_whole(t[: -len(unit)].replace(".", "", 1)):
            return int(float(t[: -len(unit)]) * factor)
    if is_whole(t):
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


def pop_dtype(args: list[str]) -> str | None:
    """``--dtype bf16|fp16|fp32`` taken out of ``args`` (in place); None when absent (the source's)."""
    if "--dtype" not in args:
        return None
    i = args.index("--dtype")
    if i + 1 >= len(args) or args[i + 1] not in DTYPES:
        got = repr(args[i + 1]) if i + 1 < len(args) else "a missing value"
        raise CheckpointError(f"--dtype: {got} is not one of {', '.join(DTYPES)}")
    value = args[i + 1]
    del args[i : i + 2]
    return value


def main(argv: list[str]) -> int:
    """``loom export hf RUN_OR_CHECKPOINT OUT_DIR [--max-shard-size 5GB] [--dtype bf16|fp16|fp32]``."""
    args = list(argv)
    size = pop_shard_size(args)
    dtype = pop_dtype(args)
    if len(args) != 3 or args[0] != "hf":
        raise CheckpointError(
            "usage: loom export hf RUN_DIR_OR_CHECKPOINT OUT_DIR [--max-shard-size 5GB] [--dtype bf16|fp16|fp32]"
        )
    done = export_hf(args[1], args[2], size, progress=True, dtype=dtype)
    print(
        f"wrote {done.out}: {done.tensors} tensors in {done.shards} shard(s), {done.total_bytes / 1e6:.1f} MB, "
        f"from {done.checkpoint} (step {done.step})"
    )
    return 0
