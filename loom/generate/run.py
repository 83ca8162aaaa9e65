"""``loom generate``: prompts in, completions out, with the speed on stderr.

Prompts run in batches of ``batch_size`` (left-padded, one KV cache per batch), or one by one
recomputing the whole context per token (``cache=False``, the reference). A completion is the
decoded new tokens, cut before the first stop string it contains; generation of a prompt ends at
an end-of-text token, a stop string or ``max_new_tokens``. Sampling options the command line leaves
unset are the model's (its ``generation_config.json``: loom.generate.source), else Loom's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from loom.generate.decode import Generation, generate_cached, generate_uncached
from loom.generate.options import Prompt, SamplingOptions
from loom.generate.source import Source


@dataclass
class Completions:
    texts: list[str]
    tokens: list[list[int]]
    prompt_ids: list[list[int]]
    runs: list[Generation]

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.runs)

    def summary(self, cache: bool) -> str:
        """One line: tokens, seconds, tokens/s, prefill time, KV cache size."""
        tps = self.new_tokens / self.seconds if self.seconds > 0 else 0.0
        how = (
            f"KV cache, prefill of {sum(r.prompt_tokens for r in self.runs)} prompt tokens "
            f"{sum(r.prefill_seconds for r in self.runs):.3f} s, cache {max(r.cache_bytes for r in self.runs) / 2**20:.2f} MiB"
            if cache
            else "no cache: whole context recomputed per token"
        )
        return (
            f"generated {self.new_tokens} tokens for {len(self.texts)} prompt(s) in {self.seconds:.3f} s: "
            f"{tps:.1f} tokens/s ({how})"
        )


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:at]


def complete(
    src: Source,
    prompts: list[Prompt],
    opts: SamplingOptions,
    chat: bool = False,
    batch_size: int = 8,
    cache: bool = True,
) -> Completions:
    """Completions of ``prompts`` (module doc); options left unset take the model's defaults
    (loom.generate.options)."""
    opts = opts.with_defaults(src.sampling)
    where = [f"--prompts (prompt {i + 1})" if len(prompts) > 1 else "--prompt" for i in range(len(prompts))]
    ids = [src.encode(p, chat, w) for p, w in zip(prompts, where, strict=True)]
    window = src.model.cfg.max_seq_len
    longer = [(w, len(i)) for w, i in zip(where, ids, strict=True) if len(i) > window]
    if longer:  # the context is cropped to the model's window (decode's module doc): say so
        w, n = longer[0]
        more = f" (and {len(longer) - 1} more)" if len(longer) > 1 else ""
        print(
            f"loom: note: {w}{more}: {n} tokens, longer than model.max_seq_len = {window}; the model sees "
            f"its last {window}",
            file=sys.stderr,
        )
    dec = src.tokenizer.decode

    def stop(_row: int, toks: list[int]) -> bool:
        return any(s in dec(toks) for s in opts.stop)

    when = stop if opts.stop else None
    runs: list[Generation] = []
    tokens: list[list[int]] = []
    for i in range(0, len(ids), batch_size if cache else len(ids)):
        chunk = ids[i : i + batch_size] if cache else ids
        run = (
            generate_cached(src.model, chunk, opts, src.eos, when)
            if cache
            else generate_uncached(src.model, chunk, opts, src.eos, when)
        )
        runs.append(run)
        tokens += run.tokens
    texts = [cut_at_stop(dec(t), opts.stop) for t in tokens]
    return Completions(texts, tokens, ids, runs)


def main(
    src: Source,
    prompts: list[Prompt],
    opts: SamplingOptions,
    chat: bool,
    batch_size: int,
    cache: bool,
    as_records: bool,
) -> int:
    """Print the completions (with ``as_records`` one JSON line per prompt, else the prompt's text
    followed by its completion, or the completion alone for a chat prompt) and the speed on stderr."""
    import json

    if src.unhonoured:
        print(src.unhonoured, file=sys.stderr)
    done = complete(src, prompts, opts, chat, batch_size, cache)
    for prompt, text in zip(prompts, done.texts, strict=True):
        if as_records:
            print(json.dumps({"prompt": prompt, "completion": text}, ensure_ascii=False))
        else:
            print(text if chat or not isinstance(prompt, str) else prompt + text)
    print(done.summary(cache), file=sys.stderr)
    return 0
