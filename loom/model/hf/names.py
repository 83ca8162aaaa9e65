"""Hugging Face checkpoints in and out of Loom's model, without ``transformers`` (JSON + safetensors).

Families: ``LlamaForCausalLM``, ``MistralForCausalLM`` (the same tensors; Mistral's sliding window
only when every sequence fits in it), ``Qwen2ForCausalLM`` (q/k/v biases: ``model.qkv_bias``; also a
Llama with ``attention_bias`` whose o biases are zero, :func:`zero_tensors`, as auto exports it; a
Llama with ``attention_bias`` and ``mlp_bias``, up's zero: ``model.bias`` on a RoPE model) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm: ``model.qk_norm``) and
``MixtralForCausalLM`` (into Loom's mixture of experts: the router, and each expert's w1/w3/w2
stacked into the (E, ...) weights), ``Qwen3MoeForCausalLM`` (Qwen3's attention, Mixtral's
experts under ``mlp.`` as ``gate_proj``/``up_proj``/``down_proj``, of width ``moe_intermediate_size``;
top-k renormalized or not: ``norm_topk_prob`` -> ``moe.norm_topk``), ``Olmo2ForCausalLM`` (norms
after attention and MLP: ``model.norm_placement = post``, its ``post_attention_layernorm`` and
``post_feedforward_layernorm`` in ``attention_norm`` and ``ffn_norm``; q/k RMSNorm over all heads at
once, a·d and k·d wide: ``model.qk_norm_scope = all``), ``GemmaForCausalLM`` (Llama's names;
``model.norm_offset``, ``embed_scale``, ``mlp = geglu_tanh``) and ``Gemma2ForCausalLM`` (also a norm
after attention and after the MLP: ``norm_placement = sandwich``; the scale and soft-caps are
config fields), ``Phi3ForCausalLM`` (Llama's
tensors, q/k/v and gate/up fused: ``model.hf_architecture`` records the family, which export writes) and ``GPT2LMHeadModel`` (``norm =
layernorm``, ``mlp = gelu_tanh``, ``positions = learned``, ``bias``). Every family but GPT-2 may give a ``head_dim`` d
with a·d != h (Mistral-Nemo: h = 5120, a = 32 heads, d = 128): ``model.attn_head_dim``, the width
of the q/k/v/o projections (a·d and k·d) and of RoPE (d). Names map one to one::

    model.embed_tokens.weight                 tok_embeddings.weight
    model.layers.i.input_layernorm            layers.i.attention_norm
    model.layers.i.self_attn.{q,k,v,o}_proj   layers.i.attention.w{q,k,v,o}   (weight, bias)
    model.layers.i.self_attn.{q,k}_norm       layers.i.attention.{q,k}_norm
    model.layers.i.post_attention_layernorm   layers.i.ffn_norm
                                              (Gemma 2: layers.i.post_attention_norm; its
                                              pre/post_feedforward_layernorm: ffn_norm, post_ffn_norm)
    model.layers.i.mlp.{gate,up,down}_proj    layers.i.feed_forward.w{1,3,2}
    model.norm.weight, lm_head.weight         norm.weight, output.weight

StarCoder 2 (``Starcoder2ForCausalLM``: RoPE, LayerNorm, a GELU MLP): Llama's attention names, its
norms' weights and biases under Llama's norm names, ``mlp.c_fc`` and ``mlp.c_proj`` as ``w1`` and ``w2``
(weights, and biases with ``use_bias``). OLMo 3 and SmolLM3 hold OLMo 2's and Llama's tensors.

Phi-3 fuses rows: ``self_attn.qkv_proj`` ((a+2k)·d, h) holds w{q,k,v} in rows [0, a·d), [a·d, (a+k)·d),
[(a+k)·d, (a+2k)·d); ``mlp.gate_up_proj`` (2f, h) holds w1 in [0, f) and w3 in [f, 2f) (a
:class:`Mapping`'s ``part``: import reads that row range, export concatenates the parts).

Rotary layout: Hugging Face rotates the halves (x_j, x_{j+r/2}) of the first r dims of each head
(r = d but for Phi-3's ``partial_rotary_factor``: ``model.rope_dims``), Loom the pairs (x_{2i},
x_{2i+1}), with the same frequencies theta^(-2i/r). The q and k projections are the same function
once each head's output rows (and biases, and the q/k norm weights) are reordered: Loom row 2i+c =
HF row i + c·r/2 for i < r/2, rows r.. d-1 kept (:func:`to_loom_rows`; :func:`to_hf_rows` is its
inverse).

GPT-2 (names under ``transformer.``, or none in the original checkpoints)::

    wte.weight, wpe.weight                    tok_embeddings.weight, pos_embeddings.weight
    h.i.ln_1, h.i.ln_2, ln_f                  layers.i.attention_norm, layers.i.ffn_norm, norm   (weight, bias)
    h.i.attn.c_attn   (h, 3h)                 layers.i.attention.w{q,k,v}: columns [j·h, (j+1)·h), transposed
    h.i.attn.c_proj, h.i.mlp.c_fc, c_proj     layers.i.attention.wo, layers.i.feed_forward.w{1,2}   (transposed)

GPT-2's ``Conv1D`` stores a weight as (in, out), the transpose of a Linear's (out, in).

Every read is of a box (:meth:`Reader.read`): a rank reads with ``safetensors``' ``get_slice`` only
the rows and columns (and experts) its parameters hold, never a whole tensor it has a piece of.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import torch

from loom.config import ModelConfig
from loom.model.hf.families import GLM4, INTERLEAVED, PHI3, architecture_of

VOCAB_TENSORS = ("tok_embeddings.weight", "output.weight")  # V rows; padded to model.pad_vocab_to in Loom


HEAD: Final = "lm_head.weight"


@dataclass(frozen=True)
class Mapping:
    """Where one Loom tensor lives in the checkpoint: ``hf`` (an expert stack: one name per expert,
    stacked along dim 0), with ``heads`` whose first ``rotary`` rows (0: all) :func:`to_loom_rows`
    reorders, ``conv1d``: stored
    transposed (in, out), and ``part`` = (offset, rows): the Loom tensor's o rows are rows
    [offset, offset + o) of an HF tensor of ``rows`` rows fusing several (GPT-2's c_attn, Phi-3's
    qkv_proj and gate_up_proj); None: the whole HF tensor."""

    hf: str | tuple[str, ...]
    heads: int | None = None
    conv1d: bool = False
    part: tuple[int, int] | None = None
    rotary: int = 0  # with heads: the rows of a head RoPE rotates (0: all)

    def names(self) -> tuple[str, ...]:
        return self.hf if isinstance(self.hf, tuple) else (self.hf,)

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of one HF tensor (one expert's) for the Loom shape ``shape``."""
        if isinstance(self.hf, tuple):
            shape = shape[1:]
        rows = shape[0] if self.part is None else self.part[1]
        return (shape[1], rows) if self.conv1d else (rows, *shape[1:])


def _mappings(cfg: ModelConfig, prefix: str | None = None) -> Iterator[tuple[str, Mapping]]:
    """(Loom name, :class:`Mapping`) of every tensor; ``prefix``: before every name (GPT-2's
    ``transformer.``, the default there; a multimodal checkpoint's text tower ``language_model.``)."""
    if cfg.positions == "learned":
        yield from _gpt2_mappings(cfg, "transformer." if prefix is None else prefix)
        return
    for lm, m in _llama_mappings(cfg):
        names = tuple((prefix or "") + n for n in m.names())
        yield lm, dataclasses.replace(m, hf=names if isinstance(m.hf, tuple) else names[0])


def _llama_mappings(cfg: ModelConfig) -> Iterator[tuple[str, Mapping]]:
    """:func:`_mappings` of a RoPE model, unprefixed."""
    family = architecture_of(cfg)
    phi3, glm4 = family == PHI3, family == GLM4
    interleaved = family in INTERLEAVED  # q/k pairs (x_2i, x_2i+1) as Loom's: rows kept
    norm_tensors = ("weight", "bias") if cfg.norm == "layernorm" else ("weight",)  # StarCoder 2's LayerNorm
    rot = cfg.rope_dims if cfg.rope_dims < cfg.head_dim else 0  # the q/k rows of a head RoPE turns (0: all)
    yield "tok_embeddings.weight", Mapping("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        hf, lm = f"model.layers.{i}.", f"layers.{i}."
        olmo2 = cfg.norm_placement == "post"  # OLMo-2: the norms after attention and MLP
        for kind in norm_tensors:
            yield (
                lm + f"attention_norm.{kind}",
                Mapping(hf + ("post_attention" if olmo2 else "input") + f"_layernorm.{kind}"),
            )
        if phi3:  # q, k, v fused into qkv_proj, rows [0, a·d), [a·d, (a+k)·d), [(a+k)·d, (a+2k)·d)
            qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            for x, heads, off in (("q", cfg.n_heads, 0), ("k", cfg.n_kv_heads, qd), ("v", None, qd + kd)):
                qkv = Mapping(hf + "self_attn.qkv_proj.weight", heads, part=(off, qd + 2 * kd), rotary=rot)
                yield lm + f"attention.w{x}.weight", qkv
        for x in "o" if phi3 else "qkvo":
            # GLM-4 pairs q/k dims as Loom does (interleaved): its rows are not reordered
            heads = None if interleaved else {"q": cfg.n_heads, "k": cfg.n_kv_heads}.get(x)
            yield lm + f"attention.w{x}.weight", Mapping(hf + f"self_attn.{x}_proj.weight", heads, rotary=rot)
            if cfg.bias or (cfg.qkv_bias and x != "o"):
                yield lm + f"attention.w{x}.bias", Mapping(hf + f"self_attn.{x}_proj.bias", heads, rotary=rot)
        if cfg.qk_norm:  # one head's d weights (OLMo-2: every head's, a·d and k·d), applied before RoPE
            whole = cfg.qk_norm_scope == "all"
            yield (
                lm + "attention.q_norm.weight",
                Mapping(hf + "self_attn.q_norm.weight", cfg.n_heads if whole else 1, rotary=rot),
            )
            yield (
                lm + "attention.k_norm.weight",
                Mapping(hf + "self_attn.k_norm.weight", cfg.n_kv_heads if whole else 1, rotary=rot),
            )
        if cfg.norm_placement == "sandwich":  # Gemma 2, GLM-4: a norm before and after attention and MLP each
            after_attn, before_mlp, after_mlp = (
                ("post_self_attn", "post_attention", "post_mlp")
                if glm4
                else ("post_attention", "pre_feedforward", "post_feedforward")
            )
            yield lm + "post_attention_norm.weight", Mapping(hf + f"{after_attn}_layernorm.weight")
            yield lm + "ffn_norm.weight", Mapping(hf + f"{before_mlp}_layernorm.weight")
            yield lm + "post_ffn_norm.weight", Mapping(hf + f"{after_mlp}_layernorm.weight")
        else:
            for kind in norm_tensors:
                yield (
                    lm + f"ffn_norm.{kind}",
                    Mapping(hf + ("post_feedforward" if olmo2 else "post_attention") + f"_layernorm.{kind}"),
                )
        if cfg.moe:  # a router, and each expert's w1/w3/w2 stacked into Loom's (E, ...) weights
            # Qwen3-MoE (q/k norms): mlp.experts.e.{gate,up,down}_proj; Mixtral: block_sparse_moe.experts.e.w*
            qwen = cfg.qk_norm
            moe = hf + ("mlp." if qwen else "block_sparse_moe.")
            yield lm + "feed_forward.router.weight", Mapping(moe + "gate.weight")
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                experts = tuple(
                    f"{moe}experts.{e}.{proj if qwen else w}.weight" for e in range(cfg.n_experts)
                )
                yield lm + f"feed_forward.{w}.weight", Mapping(experts)
            continue
        if not cfg.gated_mlp:  # StarCoder 2: c_fc, the GELU, c_proj
            for w, proj in (("w1", "c_fc"), ("w2", "c_proj")):
                for kind in ("weight", "bias") if cfg.bias else ("weight",):
                    yield lm + f"feed_forward.{w}.{kind}", Mapping(hf + f"mlp.{proj}.{kind}")
            continue
        if phi3 or glm4:  # gate and up fused into gate_up_proj: rows [0, f) and [f, 2f)
            f = cfg.resolved_ffn_dim()
            yield lm + "feed_forward.w1.weight", Mapping(hf + "mlp.gate_up_proj.weight", part=(0, 2 * f))
            yield lm + "feed_forward.w3.weight", Mapping(hf + "mlp.gate_up_proj.weight", part=(f, 2 * f))
            yield lm + "feed_forward.w2.weight", Mapping(hf + "mlp.down_proj.weight")
            continue
        for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            yield lm + f"feed_forward.{w}.weight", Mapping(hf + f"mlp.{proj}_proj.weight")
            if cfg.bias and w != "w3":  # Llama's mlp_bias; up_proj's is zero (zero_tensors)
                yield lm + f"feed_forward.{w}.bias", Mapping(hf + f"mlp.{proj}_proj.bias")
    for kind in norm_tensors:
        yield f"norm.{kind}", Mapping(f"model.norm.{kind}")
    if not cfg.tie_embeddings:
        yield "output.weight", Mapping(HEAD)


def _gpt2_mappings(cfg: ModelConfig, p: str) -> Iterator[tuple[str, Mapping]]:
    yield "tok_embeddings.weight", Mapping(p + "wte.weight")
    yield "pos_embeddings.weight", Mapping(p + "wpe.weight")
    for i in range(cfg.n_layers):
        hf, lm = f"{p}h.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            conv = kind == "weight"
            yield lm + f"attention_norm.{kind}", Mapping(hf + f"ln_1.{kind}")
            for j, x in enumerate("qkv"):
                yield (
                    lm + f"attention.w{x}.{kind}",
                    Mapping(hf + f"attn.c_attn.{kind}", conv1d=conv, part=(j * cfg.dim, 3 * cfg.dim)),
                )
            yield lm + f"attention.wo.{kind}", Mapping(hf + f"attn.c_proj.{kind}", conv1d=conv)
            yield lm + f"ffn_norm.{kind}", Mapping(hf + f"ln_2.{kind}")
            yield lm + f"feed_forward.w1.{kind}", Mapping(hf + f"mlp.c_fc.{kind}", conv1d=conv)
            yield lm + f"feed_forward.w2.{kind}", Mapping(hf + f"mlp.c_proj.{kind}", conv1d=conv)
    yield "norm.weight", Mapping(p + "ln_f.weight")
    yield "norm.bias", Mapping(p + "ln_f.bias")
    if not cfg.tie_embeddings:
        yield "output.weight", Mapping(HEAD)


def to_loom_rows(w: torch.Tensor, heads: int, rotary: int = 0) -> torch.Tensor:
    """HF q/k rows -> Loom's: per head, row 2i+c <- row i + c·r/2 for the r = ``rotary`` rotated rows
    (0: all d), the rest kept."""
    return _reorder(w, heads, rotary, (2, -1))


def to_hf_rows(w: torch.Tensor, heads: int, rotary: int = 0) -> torch.Tensor:
    """Loom q/k rows -> HF's (inverse of :func:`to_loom_rows`)."""
    return _reorder(w, heads, rotary, (-1, 2))


def _reorder(w: torch.Tensor, heads: int, rotary: int, split: tuple[int, int]) -> torch.Tensor:
    """Each head's first r rows viewed as ``split`` (2, r/2) or (r/2, 2), transposed; rows r.. kept."""
    d = w.shape[0] // heads
    r, rest = rotary or d, w.shape[1:]
    per_head = w.reshape(heads, d, *rest)
    turned = per_head[:, :r].reshape(heads, *split, *rest).transpose(1, 2).reshape(heads, r, *rest)
    return torch.cat((turned, per_head[:, r:]), 1).reshape(w.shape)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Loom name -> shape, from the config alone (no model built)."""
    h, d, f, V = cfg.dim, cfg.head_dim, cfg.resolved_ffn_dim(), cfg.vocab_size
    qd, kd = cfg.n_heads * d, cfg.n_kv_heads * d
    leaves = {
        "tok_embeddings": (V, h),
        "output": (V, h),
        "wq": (qd, h),
        "wk": (kd, h),
        "wv": (kd, h),
        "wo": (h, qd),
        "w1": (f, h),
        "w3": (f, h),
        "w2": (h, f),
        "q_norm": (qd if cfg.qk_norm_scope == "all" else d,),
        "k_norm": (kd if cfg.qk_norm_scope == "all" else d,),
        "pos_embeddings": (cfg.max_seq_len, h),
    }
    if cfg.moe:
        E = cfg.n_experts
        leaves |= {"w1": (E, f, h), "w3": (E, f, h), "w2": (E, h, f), "router": (E, h)}
    shapes = {}
    for name, _ in _mappings(cfg):
        module, kind = name.split(".")[-2:]
        shape = leaves.get(module, (h,))
        shapes[name] = shape[:1] if kind == "bias" else shape
    return shapes
