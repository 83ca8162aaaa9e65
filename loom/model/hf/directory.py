"""A local Hugging Face model directory opened: ``config.json`` read, every tensor located in its
shards and its header checked (shape, floating point, zeros where Loom has no tensor), nothing loaded."""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from loom.config import ModelConfig
from loom.model.hf.config import model_config
from loom.model.hf.families import (
    _WRONG,
    CONFIG,
    INDEX,
    OLMOE,
    QWEN3MOE,
    TEXT_TOWERS,
    HFError,
    _bool,
    architecture,
    hf_field,
    zero_tensors,
)
from loom.model.hf.names import HEAD, _mappings, expected_shapes
from loom.model.hf.quantized import FP8_DTYPES, METADATA, check_scale, scale_suffix, weight_block


@dataclass(frozen=True)
class HFModel:
    """A local Hugging Face model directory: its architecture, Loom's config for it, its shards."""

    dir: Path
    architecture: str
    config: ModelConfig
    raw: dict  # config.json as read
    files: dict[str, str]  # HF tensor name -> shard file name
    prefix: str = ""  # GPT-2: "transformer." before every name but lm_head's, or "" (original checkpoints)
    scale_suffix: str = ""  # an fp8 checkpoint: the scale beside each 8-bit weight is its name + this
    block: tuple[int, int] | None = None  # an fp8 checkpoint's stated block of one scale (rows, cols)

    def scale_of(self, name: str, dtype: str) -> str | None:
        """The scale tensor of weight ``name`` stored as ``dtype``: its name where the checkpoint
        dequantizes it (:mod:`loom.model.hf.quantized`), else None."""
        scale = name + self.scale_suffix
        return scale if self.scale_suffix and dtype.upper() in FP8_DTYPES and scale in self.files else None

    @property
    def tokenizer(self) -> Path | None:
        path = self.dir / "tokenizer.json"
        return path if path.is_file() else None


def moe_options(model: HFModel) -> dict[str, object]:
    """The ``[moe]`` settings the directory's routing fixes: Qwen3-MoE's ``norm_topk_prob`` (default
    false) as ``moe.norm_topk``; Mixtral always renormalizes (Loom's default)."""
    return (
        {"norm_topk": _bool("norm_topk_prob", hf_field(model.raw, "norm_topk_prob"))}
        if model.architecture in (QWEN3MOE, OLMOE)
        else {}
    )


@contextmanager
def open_shard(path: Path) -> Iterator[typing.Any]:
    """``safetensors.safe_open`` of one shard (its header only), a damaged or truncated file refused
    as an :class:`HFError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise HFError(
            f"{path}: not a readable safetensors file ({e}); the download may be incomplete"
        ) from None
    with f:
        yield f


def _weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> shard file of ``model.safetensors.index.json``, refused naming it if malformed."""
    try:
        raw = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{index}: not valid JSON ({e})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) and v for v in wm.values()):
        raise HFError(f"{index}: needs a 'weight_map' object of tensor name -> shard file name")
    for name, file in wm.items():
        if not _inside(file):
            raise HFError(
                f"{index}: weight_map[{name!r}] = {file!r} is not a file inside the model directory; a "
                "shard file name must be a relative path that stays inside it (e.g. 'model-00001-of-00002.safetensors'), "
                "not an absolute path or one that climbs out with '..'"
            )
    return dict(wm)


def _inside(file: str) -> bool:
    """Whether the shard file name ``file`` of a weight_map names a file inside the model directory:
    a relative path (transformers joins it to the directory: a plain file name, or one in a
    subdirectory) that, its '.' and '..' taken by the name alone, never climbs out of it. By the
    name, not by following links: a Hugging Face cache snapshot's shards are links into ``../../blobs``."""
    path = PurePosixPath(file)
    if path.is_absolute():
        return False
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return False
    return depth > 0


def open_dir(path: str | Path, max_seq_len: int = 0) -> HFModel:
    """Read ``config.json`` and locate every tensor's shard (``model.safetensors.index.json``, else
    the ``*.safetensors`` files' headers, each checked); nothing is loaded. ``max_seq_len``: as
    :func:`model_config`'s."""
    d = Path(path)
    if not (d / CONFIG).is_file():
        raise HFError(f"{d}: no {CONFIG} (expected a local Hugging Face model directory)")
    try:
        raw = json.loads((d / CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{d / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFError(f"{d / CONFIG}: not a JSON object (a Hugging Face config.json holds one)")
    try:
        cfg = model_config(raw, max_seq_len)
    except HFError:
        raise
    except KeyError as e:
        raise HFError(f"{d / CONFIG}: has no {e.args[0]!r} (a {architecture(raw)} config holds it)") from None
    except (ValueError, TypeError, AttributeError) as e:  # a type no check above names (model_config's do)
        raise HFError(f"{d / CONFIG}: {_WRONG} ({e})") from None
    if (d / INDEX).is_file():
        files = _weight_map(d / INDEX)
    else:
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        if not shards:
            pickles = sorted(p.name for p in d.glob("pytorch_model*.bin"))
            raise HFError(
                f"{d}: no *.safetensors files"
                + (
                    f" (it holds {pickles[0]}: Loom reads safetensors only, never pickles; convert it with "
                    "transformers' save_pretrained(safe_serialization=True))"
                    if pickles
                    else ""
                )
            )
        files = {}
        for name in shards:
            with open_shard(d / name) as f:
                files.update(dict.fromkeys(f.keys(), name))
    prefix = "transformer." if cfg.positions == "learned" and "transformer.wte.weight" in files else ""
    arch = architecture(raw)
    if arch in TEXT_TOWERS:  # the text model's tensors, under their prefix; the rest (vision) left out
        prefix = TEXT_TOWERS[arch]
    embedding = prefix + ("wte.weight" if cfg.positions == "learned" else "model.embed_tokens.weight")
    head = prefix + HEAD if prefix != "transformer." else HEAD  # GPT-2's head has no prefix
    if cfg.tie_embeddings and head in files and embedding in files and _differ(d, files, embedding, head):
        # transformers then loads the stored head untied ("different values, so we will NOT tie them")
        if d not in _UNTIED:
            _UNTIED.add(d)
            logging.getLogger(__name__).warning(
                "%s: %s differs from %s although tie_word_embeddings = true; untied, as transformers "
                "loads it (the stored head is the model's)",
                d,
                head,
                embedding,
            )
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    shapes = expected_shapes(cfg)
    wanted = {n: m.hf_shape(shapes[lm]) for lm, m in _mappings(cfg, prefix) for n in m.names()}
    zeros = dict(zero_tensors(cfg).values())
    model = HFModel(d, arch, cfg, raw, files, prefix, scale_suffix(raw), weight_block(raw))
    _check_headers(model, wanted | zeros)
    _check_zero(d, files, sorted(zeros))
    wanted |= zeros
    skipped = BUFFERS + (METADATA if model.scale_suffix else ())
    unused = sorted(
        n
        for n in files.keys() - wanted.keys()
        if not n.endswith(skipped) and n != HEAD and n.startswith(prefix)
    )  # a multimodal checkpoint's other towers are left out by design
    if unused and d not in _UNUSED:  # transformers drops them too ("weights not used"), and says so
        _UNUSED.add(d)
        logging.getLogger(__name__).warning(
            "%s: %d stored tensor(s) that %s does not use, ignored as transformers ignores them: %s%s",
            d,
            len(unused),
            CONFIG,
            ", ".join(unused[:3]),
            " ..." if len(unused) > 3 else "",
        )
    return model


_UNTIED: set[Path] = set()  # directories whose untied head was reported (once per process)
_UNUSED: set[Path] = set()  # directories whose unused tensors were reported
# buffers some checkpoints store that no model reads as weights: old Llama conversions' RoPE
# frequencies, the original GPT-2's causal masks (h.i.attn.bias, h.i.attn.masked_bias)
BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _check_zero(d: Path, files: dict[str, str], names: list[str]) -> None:
    """Each of ``names`` (:func:`zero_tensors`' HF names, one vector per layer) holds only zeros, else
    an error naming it: Loom's model has no such tensor to put other values in."""
    for name in names:
        with open_shard(d / files[name]) as f:
            if bool(f.get_slice(name)[:].float().count_nonzero()):
                raise HFError(
                    f"{d / files[name]}: {name} is not zero; Loom reads attention_bias = true only "
                    "as q/k/v biases with zero o_proj biases (Qwen2's attention in Llama's layout)"
                )


def _differ(d: Path, files: dict[str, str], a: str, b: str) -> bool:
    """Whether stored tensors ``a`` and ``b`` differ in shape or any value (read in blocks of rows,
    about 64 MiB at a time, never a whole table)."""
    with open_shard(d / files[a]) as fa, open_shard(d / files[b]) as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        shape = tuple(sa.get_shape())
        if shape != tuple(sb.get_shape()) or len(shape) != 2:
            return True
        step = max(1, (1 << 24) // max(1, shape[1]))
        return any(
            not torch.equal(sa[r : r + step].float(), sb[r : r + step].float())
            for r in range(0, shape[0], step)
        )


def _refuse_integer(file: Path, name: str, dtype: str) -> None:
    """A weight stored as an integer type (quantized: int8, uint8, packed int4) or an 8- or 4-bit float
    without the scale a supported ``quantization_config`` puts beside it would be cast to floats and
    trained as if its codes were values: refused, naming the file and tensor."""
    if dtype.upper().startswith(("I", "U", "BOOL", "F8", "F4", "F6")):
        kind = "integer" if not dtype.upper().startswith("F") else "an 8-bit or smaller float"
        raise HFError(
            f"{file}: tensor {name} is stored as {dtype} ({kind}, likely quantized); Loom loads "
            "16- and 32-bit floating-point weights only (dequantize it first, e.g. save the model in bfloat16)"
        )


def _check_headers(model: HFModel, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every shard's header is readable (a truncated download fails here), and every tensor Loom
    reads (``shapes``: HF name -> stored shape) is in its shard, of that shape and floating point
    (an 8-bit float only beside a scale that tiles it, :func:`~loom.model.hf.quantized.check_scale`):
    headers only, nothing loaded, so a bad directory is refused before any rank starts."""
    d, files = model.dir, model.files
    missing = sorted(shapes.keys() - files.keys())
    if missing:
        raise HFError(f"{d}: tensor {missing[0]} is missing from the checkpoint ({len(missing)} missing)")
    by_shard: dict[str, list[str]] = {shard: [] for shard in files.values()}
    for name, shard in files.items():
        if name in shapes:
            by_shard[shard].append(name)
    for shard, names in sorted(by_shard.items()):
        if not (d / shard).is_file():
            raise HFError(f"{d / shard}: missing shard file (named by {INDEX})")
        with open_shard(d / shard) as f:
            held = set(f.keys())
            for name in sorted(names):
                if name not in held:
                    raise HFError(f"{d / shard}: holds no tensor {name} ({INDEX} names it there)")
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != shapes[name]:
                    raise HFError(
                        f"{d / shard}: {name} has shape {tuple(sl.get_shape())}, {CONFIG} implies {shapes[name]}"
                    )
                scale = model.scale_of(name, sl.get_dtype())
                if scale is None:
                    _refuse_integer(d / shard, name, sl.get_dtype())
                    continue
                with open_shard(d / files[scale]) as g:
                    s = g.get_slice(scale)
                    _refuse_integer(d / files[scale], scale, s.get_dtype())
                    check_scale(d / shard, name, shapes[name], tuple(s.get_shape()), model.block)
