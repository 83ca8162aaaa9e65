"""Hugging Face checkpoints in and out of Loom's model, without ``transformers`` (JSON + safetensors).

Families: ``LlamaForCausalLM``, ``MistralForCausalLM`` (the same tensors; Mistral's sliding window
only when every sequence fits in it), ``Qwen2ForCausalLM`` (q/k/v biases: ``model.qkv_bias``) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm: ``model.qk_norm``; its own ``head_dim``) and
``MixtralForCausalLM`` (into Loom's mixture of experts: the router, and each expert's w1/w3/w2
stacked into the (E, ...) weights). Names map one to one::

    model.embed_tokens.weight                 tok_embeddings.weight
    model.layers.i.input_layernorm            layers.i.attention_norm
    model.layers.i.self_attn.{q,k,v,o}_proj   layers.i.attention.w{q,k,v,o}   (weight, bias)
    model.layers.i.self_attn.{q,k}_norm       layers.i.attention.{q,k}_norm
    model.layers.i.post_attention_layernorm   layers.i.ffn_norm
    model.layers.i.mlp.{gate,up,down}_proj    layers.i.feed_forward.w{1,3,2}
    model.norm.weight, lm_head.weight         norm.weight, output.weight

Rotary layout: Hugging Face rotates the halves (x_j, x_{j+d/2}) of each head, Loom the pairs
(x_{2i}, x_{2i+1}), with the same frequencies theta^(-2i/d). The q and k projections are the same
function once each head's output rows (and biases, and the q/k norm weights) are reordered:
Loom row 2i+c = HF row i + c·d/2 (:func:`to_loom_rows`; :func:`to_hf_rows` is its inverse).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.config import ModelConfig

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM")
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class HFError(ValueError):
    """A Hugging Face directory Loom cannot read as given; the message names the file or field."""


@dataclass(frozen=True)
class HFModel:
    """A local Hugging Face model directory: its architecture, Loom's config for it, its shards."""

    dir: Path
    architecture: str
    config: ModelConfig
    raw: dict  # config.json as read
    files: dict[str, str]  # HF tensor name -> shard file name

    @property
    def tokenizer(self) -> Path | None:
        path = self.dir / "tokenizer.json"
        return path if path.is_file() else None


def _rope(raw: dict) -> dict:
    """Loom's RoPE fields for ``config.json``: the base, and Llama 3.1's scaling if present."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = scaling | params  # transformers 5 folds rope_scaling into rope_parameters
    kind = merged.get("rope_type", merged.get("type", "default"))
    out = {"rope_theta": float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        out |= {"rope_scaling": float(merged["factor"]), "rope_low_freq_factor": float(merged["low_freq_factor"]),
                "rope_high_freq_factor": float(merged["high_freq_factor"]),
                "rope_original_len": int(merged["original_max_position_embeddings"])}  # fmt: skip
    elif kind not in (None, "default"):
        raise HFError(f"{CONFIG}: rope type {kind!r} is not supported (Loom: default, llama3)")
    return out


def model_config(raw: dict, max_seq_len: int = 0) -> ModelConfig:
    """Loom's :class:`ModelConfig` for a ``config.json``; a field Loom cannot honour raises naming it.
    ``max_seq_len``: the longest sequence to prepare RoPE for (0 = ``max_position_embeddings``)."""
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED:
        raise HFError(f"{CONFIG}: architectures = {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")
    dim, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    qwen2, qwen3 = arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"
    head_dim = int(raw.get("head_dim") or dim // heads)
    if head_dim != dim // heads and not qwen3:
        raise HFError(f"{CONFIG}: head_dim = {head_dim} differs from hidden_size / num_attention_heads "
                      f"= {dim // heads}, which {arch} does not do")  # fmt: skip
    checks = [("hidden_act", ("silu",)), ("mlp_bias", (False, None)), ("router_jitter_noise", (0.0, 0, None))]
    if not qwen2:  # Qwen2 always has q/k/v biases (and no o bias); the others only without attention_bias
        checks.append(("attention_bias", (False, None)))
    for field, allowed in checks:
        if raw.get(field) not in allowed:
            raise HFError(f"{CONFIG}: {field} = {raw.get(field)!r} is not supported (Loom: {allowed[0]!r})")
    seq = max_seq_len or int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if window is not None and seq > int(window):
        raise HFError(f"{CONFIG}: sliding_window = {window} is shorter than the sequences ({seq}); Loom "
                      "attends to the whole sequence, so it matches only when sequences fit the window")  # fmt: skip
    return ModelConfig(
        dim=dim, n_layers=int(raw["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads), ffn_dim=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]), max_seq_len=seq, **_rope(raw),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qwen2, qk_norm=qwen3, attn_head_dim=head_dim if head_dim != dim // heads else 0,
        n_experts=int(raw.get("num_local_experts", 1)), top_k=int(raw.get("num_experts_per_tok", 2)),
    )  # fmt: skip


def open_dir(path: str | Path, max_seq_len: int = 0) -> HFModel:
    """Read ``config.json`` and locate every tensor's shard (``model.safetensors.index.json``, else
    the ``*.safetensors`` files' headers); nothing is loaded."""
    from safetensors import safe_open

    d = Path(path)
    if not (d / CONFIG).is_file():
        raise HFError(f"{d}: no {CONFIG} (expected a local Hugging Face model directory)")
    raw = json.loads((d / CONFIG).read_text())
    cfg = model_config(raw, max_seq_len)
    if (d / INDEX).is_file():
        files = dict(json.loads((d / INDEX).read_text())["weight_map"])
    else:
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        if not shards:
            raise HFError(f"{d}: no *.safetensors files")
        files = {}
        for name in shards:
            with safe_open(str(d / name), "pt") as f:
                files.update(dict.fromkeys(f.keys(), name))
    for shard in sorted(set(files.values())):
        if not (d / shard).is_file():
            raise HFError(f"{d / shard}: missing shard file (named by {INDEX})")
    return HFModel(d, raw["architectures"][0], cfg, raw, files)


def apply_to(cfg, path: str | Path) -> HFModel:
    """Point a :class:`~loom.config.LoomConfig` at the HF directory ``path``: the model's shape from
    its ``config.json`` (RoPE prepared for ``data.seq_len``), and its ``tokenizer.json`` as the data
    tokenizer unless one is set. Returns the opened directory."""
    model = open_dir(path, cfg.data.seq_len)
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "rope_theta",
                  "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "attn_head_dim", "n_experts", "top_k",
                  "rope_scaling", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_len"):  # fmt: skip
        setattr(cfg.model, field, getattr(model.config, field))
    if not cfg.data.tokenizer:
        if model.tokenizer is None:
            raise HFError(f"{model.dir}: no tokenizer.json; give data.tokenizer")
        cfg.data.tokenizer = str(model.tokenizer)
    return model


def _names(cfg: ModelConfig) -> Iterator[tuple[str, str | tuple[str, ...]]]:
    """(Loom name, HF name) of every tensor; a tuple of HF names for an expert stack."""
    yield "tok_embeddings.weight", "model.embed_tokens.weight"
    for i in range(cfg.n_layers):
        hf, lm = f"model.layers.{i}.", f"layers.{i}."
        yield lm + "attention_norm.weight", hf + "input_layernorm.weight"
        for x in "qkvo":
            yield lm + f"attention.w{x}.weight", hf + f"self_attn.{x}_proj.weight"
            if cfg.qkv_bias and x != "o":
                yield lm + f"attention.w{x}.bias", hf + f"self_attn.{x}_proj.bias"
        if cfg.qk_norm:
            yield lm + "attention.q_norm.weight", hf + "self_attn.q_norm.weight"
            yield lm + "attention.k_norm.weight", hf + "self_attn.k_norm.weight"
        yield lm + "ffn_norm.weight", hf + "post_attention_layernorm.weight"
        if cfg.moe:  # Mixtral: a router, and each expert's w1/w3/w2 stacked into Loom's (E, ...) weights
            moe = hf + "block_sparse_moe."
            yield lm + "feed_forward.router.weight", moe + "gate.weight"
            for w in ("w1", "w3", "w2"):
                yield lm + f"feed_forward.{w}.weight", tuple(f"{moe}experts.{e}.{w}.weight" for e in range(cfg.n_experts))
            continue
        for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            yield lm + f"feed_forward.{w}.weight", hf + f"mlp.{proj}_proj.weight"
    yield "norm.weight", "model.norm.weight"
    if not cfg.tie_embeddings:
        yield "output.weight", "lm_head.weight"


def to_loom_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF q/k rows -> Loom's: per head, row 2i+c <- row i + c·d/2."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Loom q/k rows -> HF's (inverse of :func:`to_loom_rows`)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _heads_of(name: str, cfg: ModelConfig) -> int | None:
    """Heads whose rows :func:`to_loom_rows` reorders in this tensor (None: not a rotary tensor)."""
    if ".attention.wq." in name:
        return cfg.n_heads
    if ".attention.wk." in name:
        return cfg.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one head's d weights, applied before RoPE
    return None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Loom name -> shape, from the config alone (no model built)."""
    h, d, f, V = cfg.dim, cfg.head_dim, cfg.resolved_ffn_dim(), cfg.vocab_size
    qd, kd = cfg.n_heads * d, cfg.n_kv_heads * d
    leaves = {"tok_embeddings": (V, h), "output": (V, h), "wq": (qd, h), "wk": (kd, h), "wv": (kd, h), "wo": (h, qd),
              "w1": (f, h), "w3": (f, h), "w2": (h, f), "q_norm": (d,), "k_norm": (d,)}  # fmt: skip
    if cfg.moe:
        E = cfg.n_experts
        leaves |= {"w1": (E, f, h), "w3": (E, f, h), "w2": (E, h, f), "router": (E, h)}
    shapes = {}
    for name, _ in _names(cfg):
        module, kind = name.split(".")[-2:]
        shape = leaves.get(module, (h,))
        shapes[name] = shape[:1] if kind == "bias" else shape
    return shapes


def read_state(model: HFModel, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Loom name, tensor) for ``names`` (default: all), one tensor at a time (an expert stack is read
    expert by expert); each shard file is opened once."""
    from contextlib import ExitStack

    from safetensors import safe_open

    shapes = expected_shapes(model.config)
    wanted = [(lm, hf) for lm, hf in _names(model.config) if names is None or lm in names]
    for _, hf in wanted:
        for name in _parts(hf):
            if name not in model.files:
                raise HFError(f"{model.dir}: tensor {name} is missing from the checkpoint")
    with ExitStack() as files:
        opened: dict[str, object] = {}

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            file = model.files[name]
            if file not in opened:
                opened[file] = files.enter_context(safe_open(str(model.dir / file), "pt"))
            t = opened[file].get_tensor(name)  # type: ignore[attr-defined]
            if tuple(t.shape) != shape:
                raise HFError(f"{model.dir / file}: {name} has shape {tuple(t.shape)}, {CONFIG} implies {shape}")
            return t

        for lm, hf in wanted:
            if isinstance(hf, tuple):  # experts stacked along dim 0
                t = torch.stack([get(name, shapes[lm][1:]) for name in hf])
            else:
                t = get(hf, shapes[lm])
            heads = _heads_of(lm, model.config)
            yield lm, (to_loom_rows(t, heads) if heads else t)


def _parts(hf: str | tuple[str, ...]) -> tuple[str, ...]:
    return hf if isinstance(hf, tuple) else (hf,)


def source(model: HFModel) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """The whole value of a Loom parameter by name, read from the checkpoint when asked (for
    materializing a model built on the meta device: each rank reads the parameters it holds a piece of)."""

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        for _, t in read_state(model, {name}):
            return t
        raise HFError(f"{model.dir}: the checkpoint has no tensor for Loom's {name}")

    return read


@torch.no_grad()
def load_into(module: torch.nn.Module, model: HFModel) -> None:
    """Copy the checkpoint's weights into a Loom ``Transformer`` built from ``model.config``
    (converted to each parameter's dtype and device, one tensor at a time)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, t in read_state(model, set(params)):
        params[name].copy_(t)


def architecture_of(cfg: ModelConfig) -> str:
    """The Hugging Face family that holds exactly ``cfg``'s tensors."""
    if cfg.qk_norm and not cfg.qkv_bias:
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias and not cfg.qk_norm:
        return "Qwen2ForCausalLM"
    if cfg.qkv_bias or (cfg.moe and cfg.qk_norm):
        raise HFError("model: no supported Hugging Face family has this combination of q/k/v biases, q/k norms "
                      "and experts")  # fmt: skip
    return "MixtralForCausalLM" if cfg.moe else "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, dtype: str = "float32", extra: dict | None = None) -> dict:
    """``config.json`` for Loom's ``cfg`` (``extra``: fields carried over, e.g. token ids)."""
    architecture = architecture_of(cfg)
    out = {
        "architectures": [architecture], "model_type": architecture.removesuffix("ForCausalLM").lower(),
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.resolved_ffn_dim(),
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": cfg.qkv_bias,
        "mlp_bias": False, "initializer_range": cfg.init_std, "dtype": dtype,
    }  # fmt: skip
    if cfg.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_len}  # fmt: skip
        out |= {"rope_parameters": rope, "rope_scaling": rope}
    if cfg.moe:
        out |= {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "router_jitter_noise": 0.0,
                "output_router_logits": False}  # fmt: skip
    return out | (extra or {})


def hf_tensors(cfg: ModelConfig, state: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for a stream of Loom (name, tensor); names outside the mapping raise."""
    to_hf = dict(_names(cfg))
    for name, t in state:
        if name not in to_hf:
            if cfg.tie_embeddings and name == "output.weight":
                continue  # the tied head is the embedding
            raise HFError(f"{name}: no Hugging Face counterpart for this tensor")
        heads = _heads_of(name, cfg)
        t = to_hf_rows(t, heads) if heads else t
        hf = to_hf[name]
        if isinstance(hf, tuple):
            yield from ((n, e.contiguous()) for n, e in zip(hf, t.unbind(0), strict=True))
        else:
            yield hf, t.contiguous()
