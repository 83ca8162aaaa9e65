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

The tokenizer's side files (:data:`TOKENIZER_FILES`) are those the run kept beside its
``tokenizer.json`` when it started (:func:`keep_tokenizer_files`; ``data.json`` records their
SHA-256), whatever the working directory and wherever its tokenizer directory went since; a run
from an older Loom kept none: ``data.tokenizer``'s directory then, and a chat run whose
``data.tokenizer`` is not found is refused (its template would silently become the built-in one).
A copied ``tokenizer_config.json`` keeps every field it has and gets a pad token (the
``pad_token_id`` of ``config.json``) and ``model_max_length`` where it has none (batched
tokenization needs one); a ``generation_config.json`` Loom writes lists as ``eos_token_id`` every
id that ends a turn or a document (the tokenizer config's ``eos_token`` and the end-of-text id).
"""

from __future__ import annotations

import json
import logging
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
    DATA_IDENTITY,
    MODEL_FILE_METADATA,
    CheckpointError,
    check_outside_checkpoints,
    check_run_tokenizer,
    check_trained_tokenizer,
    staged,
    umask_mode,
)
from loom.checkpoint.integrity import sha256_file
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
TEMPLATES_DIR = "chat_templates"  # named chat templates, one .jinja file each (copied, not hashed)
KEPT = "run.dir/"  # data.json: "run.dir/NAME" = the SHA-256 of the side file NAME a run keeps ("": none)
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
    tokenizer_problem: str | None = None  # check_auto_tokenizer's line: AutoTokenizer encodes otherwise


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
        a, b = model_config(raw), model_config(ours)
    except (ValueError, KeyError, TypeError):
        return not any(f in raw and f in ours and raw[f] != ours[f] for f in SHAPE_FIELDS)
    return all(getattr(a, f) == getattr(b, f) for f in SHAPE)


# config.json's weight dtype: transformers >= 4.56 reads dtype, older versions (and vLLM on them) torch_dtype
DTYPE_KEYS = ("dtype", "torch_dtype")


def carried_config(ours: dict, src: Path | None) -> dict:
    """``config.json``: Loom's description ``ours`` with every field of the source directory's
    ``config.json`` carried over when the source describes the same tensors (module doc)."""
    if src is None:
        return ours
    raw = _read_json(src / "config.json")
    arch, mine = architecture(raw), ours["architectures"][0]
    if SAME_TENSORS.get(arch, arch) != SAME_TENSORS.get(mine, mine) or not _same_tensors(raw, ours):
        return ours  # the model changed shape or family since: describe what was trained
    # not the source's quantization: Loom writes the weights in its own precision (dequantized)
    kept = {
        k: v for k, v in raw.items() if k not in DTYPE_KEYS + ("transformers_version", "quantization_config")
    }
    return ours | kept | {k: ours[k] for k in DTYPE_KEYS if k in ours}


def is_chat(cfg: C.LoomConfig) -> bool:
    """The run trained on chat data (``data.format``, or a source's, is chat)."""
    return cfg.data.format == "chat" or any(src.format == "chat" for src in cfg.data.sources)


def _named_dir(cfg: C.LoomConfig) -> Path | None:
    """The directory ``data.tokenizer`` names (itself, or the file's), as given; None: unset."""
    if not cfg.data.tokenizer:
        return None
    p = Path(cfg.data.tokenizer).expanduser()
    return p if p.is_dir() else p.parent


def _side_dir(cfg: C.LoomConfig) -> Path | None:
    """The first of ``data.tokenizer``'s directory and the Hugging Face directory the run started
    from that holds a side file of the tokenizer; None: neither does."""
    for d in (_named_dir(cfg), source_dir(cfg)):
        if d is not None and any((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    return None


def keep_tokenizer_files(cfg: C.LoomConfig, run_dir: Path) -> dict[str, str]:
    """Copy the tokenizer's side files (:func:`_side_dir`) beside ``run_dir/tokenizer.json`` when a
    run starts; returns their SHA-256 for ``data.json`` (:data:`KEPT`; "" for a file it has none of,
    which the run then holds none of either)."""
    from loom.checkpoint.integrity import sha256_file

    d = _side_dir(cfg)
    kept = {}
    for f in TOKENIZER_FILES:
        if d is not None and (d / f).is_file():
            shutil.copyfile(d / f, run_dir / f)
            kept[KEPT + f] = sha256_file(run_dir / f)
        else:
            (run_dir / f).unlink(missing_ok=True)  # an earlier start's: not this tokenizer's
            kept[KEPT + f] = ""
    if d is not None and (d / TEMPLATES_DIR).is_dir():
        shutil.copytree(d / TEMPLATES_DIR, run_dir / TEMPLATES_DIR, dirs_exist_ok=True)
    return kept


def kept_files(run_dir: Path) -> dict[str, str]:
    """What ``run_dir/data.json`` records of the side files the run keeps (:data:`KEPT` entries);
    {} for a run that recorded none (an older Loom's, or an unreadable record)."""
    ident = run_dir / DATA_IDENTITY
    try:
        record = json.loads(ident.read_text(encoding="utf-8")) if ident.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in record.items() if k.startswith(KEPT)} if isinstance(record, dict) else {}


def run_tokenizer_dir(run_dir: Path, cfg: C.LoomConfig) -> Path | None:
    """Where the side files describing a run's tokenizer are read (module doc): the run's own copies
    (``run_dir``, for a run that keeps or recorded them), else :func:`_side_dir`; a chat run of neither
    whose ``data.tokenizer`` is not found is refused in one line. None: there are none."""
    if kept_files(run_dir) or any((run_dir / f).is_file() for f in TOKENIZER_FILES):
        return run_dir
    named = cfg.data.tokenizer
    if named and is_chat(cfg) and not Path(named).expanduser().exists():
        raise CheckpointError(
            f"data.tokenizer: {named} not found from {Path.cwd()}; the chat run {run_dir} keeps no copy of "
            "its tokenizer's chat template (an older run): run this from the directory it was trained in, "
            f"or copy {' / '.join(TOKENIZER_FILES)} of its tokenizer directory into {run_dir}"
        )
    return _side_dir(cfg)


def _token_name(value: Any) -> str:
    """A special token of ``tokenizer_config.json``: a string, or an AddedToken object's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _eos_name(side: Path | None) -> str:
    """The ``eos_token`` of ``side``'s ``tokenizer_config.json``, else of its ``special_tokens_map.json``."""
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        path = side / f if side is not None else None
        name = _token_name(_read_json(path).get("eos_token")) if path and path.is_file() else ""
        if name:
            return name
    return ""


def end_tokens(tok: Any, side: Path | None, eos: object = None) -> list[int]:
    """Every id that ends a turn or a document, each once: the tokenizer config's ``eos_token``
    (:func:`_eos_name` of the side files in ``side``) where the vocabulary has it, then ``eos`` (an id
    or a list: a config's ``eos_token_id``), else the tokenizer's end-of-document token
    (loom.data.tokenizer.EOT_CANDIDATES)."""
    from loom.data.tokenizer import EOT_CANDIDATES

    name = _eos_name(side)
    named = [tok.token_to_id(name)] if name and tok.token_to_id(name) is not None else []
    given = [eos] if isinstance(eos, int) else [int(i) for i in eos] if isinstance(eos, list) else []
    found = (tok.token_to_id(n) for n in EOT_CANDIDATES)
    rest = given or next(([i] for i in found if i is not None), [])
    return list(dict.fromkeys([*named, *rest]))


def tokenizer_source(run_dir: Path, cfg: C.LoomConfig) -> Path | None:
    """The ``tokenizer.json`` an export ships: the run's copy, else ``data.tokenizer``, else the
    prepared data's (None: none of them is there)."""
    candidates = (
        run_dir / "tokenizer.json",
        Path(cfg.data.tokenizer or "-"),
        Path(cfg.data.prepared_dir or "-") / "tokenizer.json",
    )
    return next((p for p in candidates if p.is_file()), None)


def _tokenizer_files(run_dir: Path, cfg: C.LoomConfig, tmp: Path, config: dict) -> dict[str, Any]:
    """Copy the run's ``tokenizer.json`` and the files describing it for ``AutoTokenizer`` (its side
    files, :func:`run_tokenizer_dir`, completed by :func:`_complete_tokenizer_config`; else a
    ``tokenizer_config.json`` of Loom's tokenizer); returns the special ids for ``config.json`` (the
    source's where it gives them)."""
    from loom.data.tokenizer import eot_id, load_tokenizer

    src = tokenizer_source(run_dir, cfg)
    if src is None:
        return {}
    shutil.copyfile(src, tmp / "tokenizer.json")
    _legacy_merges(tmp / "tokenizer.json")
    d = run_tokenizer_dir(run_dir, cfg)
    copied = d is not None and any((d / f).is_file() for f in TOKENIZER_FILES)
    if d is not None and copied:
        for f in TOKENIZER_FILES:
            if (d / f).is_file():
                shutil.copyfile(d / f, tmp / f)
        if (d / TEMPLATES_DIR).is_dir():
            shutil.copytree(d / TEMPLATES_DIR, tmp / TEMPLATES_DIR)
    tok = load_tokenizer(src)
    eot = eot_id(tok)
    special = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    } or {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}
    if copied:
        _complete_tokenizer_config(
            tmp, tok.id_to_token(special.get("pad_token_id", eot)), cfg.model.max_seq_len
        )
    else:
        name = tok.id_to_token(eot)
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": GENERIC_TOKENIZER,
                    "bos_token": name,  # Loom's tokenizer: <|endoftext|> opens and ends documents
                    "eos_token": name,
                    # and pads (masked by the attention mask): batched tokenizers and pipelines need one
                    "pad_token": name,
                    "model_max_length": cfg.model.max_seq_len,
                    "model_input_names": list(MODEL_INPUT_NAMES),
                    "clean_up_tokenization_spaces": False,  # decode gives back the text encoded
                },
                indent=2,
            )
        )
    tcfg = tmp / "tokenizer_config.json"
    templated = (tmp / "chat_template.jinja").is_file() or (
        tcfg.is_file() and "chat_template" in _read_json(tcfg)
    )
    if is_chat(cfg) and not templated:  # trained on Loom's built-in rendering: apply_chat_template gives it
        (tmp / "chat_template.jinja").write_text(BUILTIN_CHAT_TEMPLATE)
    jinja = tmp / "chat_template.jinja"
    if jinja.is_file() and tcfg.is_file() and "chat_template" not in (fields := _read_json(tcfg)):
        # transformers < 4.47 reads the template from tokenizer_config.json only
        tcfg.write_text(json.dumps(fields | {"chat_template": jinja.read_text(encoding="utf-8")}, indent=2))
    return special


def _legacy_merges(path: Path) -> None:
    """``tokenizers`` >= 0.20 writes a BPE model's merges as pairs (``[["Ġ", "t"]]``), which 0.19 and
    older (transformers <= 4.44) cannot read; where no part holds a space they are written as the
    ``"Ġ t"`` strings every version reads: the same merges."""
    data = _read_json(path)
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return
    merges = model.get("merges")
    if not merges or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return
    if any(not isinstance(part, str) or " " in part for m in merges for part in m):
        return
    model["merges"] = [" ".join(m) for m in merges]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# the tokenizer class every transformers version loads a tokenizer.json with as shipped (5.x: the same
# class as its TokenizersBackend)
GENERIC_TOKENIZER = "PreTrainedTokenizerFast"
# what a causal LM's tokenizer returns: PreTrainedTokenizerFast adds token_type_ids otherwise, which
# generate(**tokenizer(text)) refuses ("model_kwargs are not used") in transformers 4.x
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")


def _complete_tokenizer_config(tmp: Path, pad: str | None, max_len: int) -> None:
    """The copied ``tokenizer_config.json`` (written if the source had only other side files) with a
    ``pad_token`` (``pad``: ``config.json``'s pad id's token) where neither it nor
    ``special_tokens_map.json`` names one, and ``model_max_length`` where it has none; every field
    it has is kept."""
    path, smap = tmp / "tokenizer_config.json", tmp / "special_tokens_map.json"
    tcfg = _read_json(path) if path.is_file() else {"tokenizer_class": GENERIC_TOKENIZER}
    added: dict[str, Any] = {}
    if tcfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        # transformers 5 names its generic class TokenizersBackend, which 4.x lacks; with no class 4.x
        # takes the model type's (LlamaTokenizerFast adds <s> and <unk> beyond the vocabulary)
        if tcfg.get("backend") == "tokenizers":
            del tcfg["backend"]
        added["tokenizer_class"] = GENERIC_TOKENIZER
    if (
        pad
        and tcfg.get("pad_token") is None
        and (not smap.is_file() or _read_json(smap).get("pad_token") is None)
    ):
        added["pad_token"] = pad
    if "model_max_length" not in tcfg:
        added["model_max_length"] = max_len
    if "model_input_names" not in tcfg:
        added["model_input_names"] = list(MODEL_INPUT_NAMES)
    if "clean_up_tokenization_spaces" not in tcfg:  # 4.x defaults to True: decode("a , b") gives "a, b"
        added["clean_up_tokenization_spaces"] = False
    if added or not path.is_file():
        path.write_text(json.dumps(tcfg | added, indent=2))


# text on which pre-tokenizers disagree: digit runs, contractions in capitals, punctuation before
# letters, blank lines, tabs, a decomposed accent (NFC), CJK and an emoji
PROBE = "Hello, world! DON'T stop: 12345 apples...\n\n\tx=y+1; // cafe\u0301 \u4e2d\u6587 \U0001f642 it's\r\n"


def check_auto_tokenizer(d: Path) -> str | None:
    """Whether ``transformers``' ``AutoTokenizer`` loads the directory ``d``'s tokenizer as the
    ``tokenizer.json`` it ships: the ids of :data:`PROBE` compared (transformers forces its own class,
    pre-tokenizer and all, on some model types). Returns the problem in one line, or None (the same
    ids, no tokenizer, or transformers not installed)."""
    if not (d / "tokenizer.json").is_file():
        return None
    from loom.data.tokenizer import load_tokenizer

    shipped = load_tokenizer(d / "tokenizer.json")
    enc, size = (
        shipped.encode(PROBE, add_special_tokens=False),
        shipped.get_vocab_size(with_added_tokens=True),
    )
    want = enc.ids
    try:
        import transformers
    except ModuleNotFoundError:  # not installed: nothing loads it the way that library would
        return None
    except Exception as e:  # installed but broken: the export stands, unchecked
        return f"transformers does not import ({type(e).__name__}: {e}); the tokenizer was not checked"
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its notes on the class it picks: the check says what matters
    try:
        auto = transformers.AutoTokenizer.from_pretrained(str(d))
        got = auto(PROBE, add_special_tokens=False)["input_ids"]
        unknown = [
            i for i in auto(PROBE)["input_ids"] if i >= size
        ]  # as generate(**tokenizer(text)) sees them
    except Exception as e:  # any failure to load is the finding itself
        return f"transformers' AutoTokenizer cannot load the tokenizer ({type(e).__name__}: {e})"
    finally:
        transformers.logging.set_verbosity(level)
    if unknown:
        return (
            f"transformers' AutoTokenizer loads the tokenizer as {type(auto).__name__}, which adds ids "
            f"{sorted(set(unknown))[:3]} beyond the {size} of the tokenizer.json it ships (special tokens it "
            "invents); load it with transformers.PreTrainedTokenizerFast.from_pretrained"
        )
    if got == want:
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    a, b = enc.offsets[min(i, len(want) - 1)] if want else (0, len(PROBE))
    return (
        f"transformers' AutoTokenizer loads the tokenizer as {type(auto).__name__}, which encodes text "
        f"otherwise than the tokenizer.json it ships (from {PROBE[a:b]!r} on); load it with "
        "transformers.PreTrainedTokenizerFast.from_pretrained"
    )


def _generation_config(tmp: Path, special: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` of an export whose source has none: the special ids, with
    ``eos_token_id`` listing every id that ends a turn or a document (:func:`end_tokens` of the
    exported tokenizer: an id, or a list when there are several)."""
    from loom.data.tokenizer import load_tokenizer

    if not special or not (tmp / "tokenizer.json").is_file():
        return special
    ends = end_tokens(load_tokenizer(tmp / "tokenizer.json"), tmp, special.get("eos_token_id"))
    return special | ({"eos_token_id": ends if len(ends) > 1 else ends[0]} if ends else {})


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
        run_dir = opened.dir.parent.parent
        check_run_tokenizer(run_dir)  # the tokenizer it ships: before anything is written
        if (shipped := tokenizer_source(run_dir, cfg)) is not None:  # the one this checkpoint trained with
            check_trained_tokenizer(opened.train_state, sha256_file(shipped), opened.dir, str(shipped))
        run_tokenizer_dir(run_dir, cfg)  # and the files describing it
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
            special = _tokenizer_files(run_dir, cfg, tmp, config)
            config |= special
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            if hf_src is not None and (hf_src / "generation_config.json").is_file():
                shutil.copyfile(hf_src / "generation_config.json", tmp / "generation_config.json")
            else:
                (tmp / "generation_config.json").write_text(
                    json.dumps(_generation_config(tmp, special), indent=2)
                )
            problem = check_auto_tokenizer(tmp)
        if problem:
            logging.getLogger(__name__).warning("%s: %s", out, problem)
        return Exported(out, reader.dir, reader.step, len(shards), len(weight_map), total, problem)


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
        save_file(tensors, str(tmp / file), metadata=MODEL_FILE_METADATA)
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
