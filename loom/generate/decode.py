"""Token generation: the next-token rule (loom.generate.options) and the decoding loops, with a KV
cache (batched, left-padded: loom.model.kv_cache) or by recomputing the whole context per token
(the reference; one prompt at a time).

Both see at most ``model.max_seq_len`` tokens: a longer context keeps its last ``max_seq_len``
(with the cache: once the window is full, each further step re-fills the cache from the last
``max_seq_len`` tokens, as the reference does; the repetition penalty still sees every token of the
sequence). ``eos`` ends a prompt's generation after that token;
``stop(row, tokens)`` is asked after every new token (stop strings).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from loom.generate.options import SamplingOptions
from loom.model.kv_cache import KVCache, forward_cached, new_cache
from loom.model.llama import Transformer

Stop = Callable[[int, list[int]], bool]


@dataclass
class Generation:
    """New tokens of each prompt, and timing: prefill (prompt) and decode (new tokens) seconds."""

    tokens: list[list[int]]
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    cache_bytes: int = 0
    steps: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def generators(n: int, seed: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per prompt, each seeded with ``seed`` (a prompt samples alike alone or in a batch)."""
    return [torch.Generator(device=device).manual_seed(seed) for _ in range(n)]


def next_token(
    logits: torch.Tensor,
    opts: SamplingOptions,
    gens: Sequence[torch.Generator],
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token (B,) from logits (B, V): the repetition penalty on the tokens ``seen`` (B, V) marks
    (those already in each sequence), then greedy, or temperature / top-k / top-p sampling
    (loom.generate.options), row b drawing with ``gens[b]``."""
    rule = opts.rule()
    logits = logits.float()
    if seen is not None and rule.repetition_penalty != 1:
        r = rule.repetition_penalty
        logits = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    if rule.temperature == 0:
        return logits.argmax(-1)
    # shifted to a max of 0 first (softmax is unchanged): a temperature near 0 sends the rest to -inf,
    # not the max to inf (inf - inf: NaN probabilities), so it samples the argmax as 0 would
    t = max(rule.temperature, torch.finfo(logits.dtype).tiny)  # below it the float is 0 (0 / 0: NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / t
    if rule.top_k > 0:
        kth = torch.topk(logits, min(rule.top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if rule.top_p < 1:
        probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the tokens more likely than each
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(
            -1, order, before >= rule.top_p
        )  # vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))  # the most likely token always stays (before = 0)
    probs = torch.softmax(logits, -1)
    return torch.cat([torch.multinomial(probs[b : b + 1], 1, generator=g)[0] for b, g in enumerate(gens)])


def seen_tokens(prompts: list[list[int]], logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor | None:
    """The tokens of each prompt as a mask (B, V) the width of ``logits``, for the repetition penalty;
    None when there is none (its new tokens are added as they come: :func:`mark`)."""
    if opts.rule().repetition_penalty == 1:
        return None
    seen = torch.zeros(len(prompts), logits.shape[-1], dtype=torch.bool, device=logits.device)
    for b, p in enumerate(prompts):
        seen[b, torch.tensor(p, dtype=torch.long, device=logits.device)] = True
    return seen


def mark(seen: torch.Tensor | None, tokens: torch.Tensor) -> None:
    """Add each row's new token (B,) to ``seen`` (in place; nothing without a penalty)."""
    if seen is not None:
        seen.scatter_(1, tokens[:, None], True)


def _finished(row: int, tok: int, out: list[int], eos: frozenset[int], stop: Stop | None) -> bool:
    return tok in eos or (stop is not None and stop(row, out))


@torch.no_grad()
def generate_cached(
    model: Transformer,
    prompts: list[list[int]],
    opts: SamplingOptions,
    eos: frozenset[int] = frozenset(),
    stop: Stop | None = None,
    pad_id: int = 0,
) -> Generation:
    """Generate for a batch of prompts at once: left-padded to the longest, with a KV cache."""
    model.eval()
    L = model.cfg.max_seq_len
    dev = model.tok_embeddings.weight.device
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    gens = generators(len(prompts), opts.seed, dev)
    out: list[list[int]] = [[] for _ in prompts]
    alive = [True] * len(prompts)
    res = Generation(out, prompt_tokens=sum(min(len(p), L) for p in prompts))
    if opts.max_new_tokens == 0:
        return res
    t0 = time.perf_counter()
    cache, logits = _prefill(model, ids, pad, min(L, P + opts.max_new_tokens - 1))
    res.prefill_seconds = time.perf_counter() - t0
    res.cache_bytes = cache.nbytes
    seen = seen_tokens(prompts, logits, opts)
    for step in range(opts.max_new_tokens):
        nxt = next_token(logits, opts, gens, seen)  # (B,)
        mark(seen, nxt)
        for b, tok in enumerate(nxt.tolist()):
            if alive[b]:
                out[b].append(tok)
                alive[b] = not _finished(b, tok, out[b], eos, stop)
        res.steps.append(time.perf_counter() - t0)
        if not any(alive) or step == opts.max_new_tokens - 1:
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if cache.length == cache.capacity:  # the window is full: the last L tokens afresh
            cache, logits = _prefill(model, ids, pad, L)
        else:
            logits = forward_cached(model, nxt[:, None], cache)[:, -1]
    res.seconds = time.perf_counter() - t0
    return res


def _prefill(
    model: Transformer, ids: torch.Tensor, pad: torch.Tensor, slots: int
) -> tuple[KVCache, torch.Tensor]:
    """A cache of ``slots`` filled with the last min(T, max_seq_len) columns of ``ids`` (B, T), and
    the logits (B, V) of the next token."""
    cut = max(0, ids.shape[1] - model.cfg.max_seq_len)
    window, pad = ids[:, cut:], (pad - cut).clamp(min=0)
    cache = new_cache(model, ids.shape[0], max(slots, window.shape[1]), pad)
    return cache, forward_cached(model, window, cache)[:, -1]


@torch.no_grad()
def generate_uncached(
    model: Transformer,
    prompts: list[list[int]],
    opts: SamplingOptions,
    eos: frozenset[int] = frozenset(),
    stop: Stop | None = None,
) -> Generation:
    """The reference: each prompt alone, the model's training forward over the whole (cropped)
    context for every new token."""
    model.eval()
    L = model.cfg.max_seq_len
    dev = model.tok_embeddings.weight.device
    res = Generation([], prompt_tokens=sum(min(len(p), L) for p in prompts))
    t0 = time.perf_counter()
    for b, prompt in enumerate(prompts):
        gen = generators(1, opts.seed, dev)
        ids = torch.tensor([prompt], dtype=torch.long, device=dev)
        new: list[int] = []
        seen: torch.Tensor | None = None
        for _ in range(opts.max_new_tokens):
            logits = model(ids[:, -L:])[:, -1]
            seen = seen_tokens([prompt], logits, opts) if seen is None else seen
            nxt = next_token(logits, opts, gen, seen)
            mark(seen, nxt)
            tok = int(nxt[0])
            new.append(tok)
            res.steps.append(time.perf_counter() - t0)
            if _finished(b, tok, new, eos, stop):
                break
            ids = torch.cat([ids, torch.tensor([[tok]], device=dev)], dim=1)
        res.tokens.append(new)
    res.seconds = time.perf_counter() - t0
    return res
