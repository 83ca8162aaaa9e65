"""Sample text from a trained run directory (config.toml + tokenizer.json + final weights)."""

from __future__ import annotations

from pathlib import Path

import torch

from loom import config as C
from loom.model.llama import Transformer
from loom.train.export import load_model


@torch.no_grad()
def sample(
    model: Transformer, ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int, gen: torch.Generator
) -> torch.Tensor:
    """Autoregressive sampling (full recompute per token; the context is cropped to max_seq_len)."""
    model.eval()
    for _ in range(max_new_tokens):
        ctx = ids[:, -model.cfg.max_seq_len :]
        logits = model(ctx)[:, -1, :].float()  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def generate_from_run(
    run_dir: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50, seed: int = 0
) -> str:
    from tokenizers import Tokenizer

    d = Path(run_dir)
    weights = d / "checkpoints" / "final" / "model.safetensors"
    for f in (d / "config.toml", d / "tokenizer.json", weights):
        if not f.exists():
            raise C.ConfigError(f"run.dir: {f} not found; train first with loom train --run.dir {run_dir}")
    cfg = C.load_toml(d / "config.toml")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    model = Transformer(cfg.model)
    load_model(model, weights)
    ids = tok.encode(prompt).ids or [0]
    gen = torch.Generator().manual_seed(seed)
    out = sample(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, gen)
    return tok.decode(out[0].tolist())
