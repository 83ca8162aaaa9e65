"""Sample text from a trained run directory (config.toml + tokenizer.json + final weights).

The final weights are checked before they are used: ``checkpoints/final/model.safetensors`` must
have the SHA-256 ``final/meta.json`` records, if it records one; else, as an export of the run's
last checkpoint (its header names it), that checkpoint is verified against its manifest (and the
hash ``latest`` recorded) and every tensor of the file must equal it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom import config as C
from loom.checkpoint.format import LATEST, CheckpointError, check_header, read_json
from loom.data.tokenizer import load_tokenizer
from loom.model.llama import Transformer
from loom.train.export import load_model

PREFIX = "model."  # names of the model's tensors in a checkpoint (loom.checkpoint.convert)


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


def verify_final(run_dir: Path, weights: Path) -> None:
    """Refuse ``weights`` unless it has the SHA-256 its ``meta.json`` records, or (when none is
    recorded) equals the model tensors of the verified checkpoint it was exported from (named in
    its safetensors header, under ``run_dir/checkpoints``)."""
    from safetensors import safe_open

    from loom.checkpoint.integrity import sha256_file
    from loom.checkpoint.load import CheckpointReader

    check_header(weights)
    meta = weights.parent / "meta.json"
    recorded = read_json(meta).get("sha256") if meta.is_file() else None
    if recorded:
        if sha256_file(weights) != recorded:
            raise CheckpointError(f"{weights}: content altered (its SHA-256 differs from the one recorded in {meta})")
        return
    try:
        with safe_open(str(weights), framework="pt") as f:
            source = (f.metadata() or {}).get("source", "")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    except Exception as e:  # safetensors raises its own error type for a damaged header or body
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    root = run_dir / "checkpoints"
    ckpt = root / source
    if not source or "/" in source or "\\" in source or source.startswith(".") or not ckpt.is_dir():
        raise CheckpointError(f"{weights}: cannot be verified: the checkpoint it was exported from ({source or '?'}) is "
                              f"not in {root}; export a model with loom checkpoint convert and load that")  # fmt: skip
    expect = None
    if (root / LATEST).is_file():
        latest = read_json(root / LATEST)
        if latest.get("tag") == source:
            expect = str(latest.get("manifest_sha256") or "") or None
    with CheckpointReader(ckpt, manifest_sha=expect) as reader:
        names = {n[len(PREFIX) :] for n in reader.names() if n.startswith(PREFIX)}
        if names != set(tensors):
            extra, missing = sorted(set(tensors) - names)[:3], sorted(names - set(tensors))[:3]
            raise CheckpointError(f"{weights}: its tensors differ from {ckpt}'s (extra {extra}, missing {missing}); "
                                  "the file was altered")  # fmt: skip
        for name, t in tensors.items():
            if not torch.equal(t, reader.read(PREFIX + name)):
                raise CheckpointError(f"{weights}: tensor {name} differs from {ckpt}, which it was exported from "
                                      "(the file was altered)")  # fmt: skip


def generate_from_run(
    run_dir: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50, seed: int = 0
) -> str:
    if not run_dir.strip():
        raise C.ConfigError("run.dir: must name a directory written by loom train, got ''")
    d = Path(run_dir)
    if not d.is_dir():
        raise C.ConfigError(f"run.dir: {d} is not a directory; train first with loom train --run.dir {run_dir}")
    weights = d / "checkpoints" / "final" / "model.safetensors"
    for f in (d / "config.toml", d / "tokenizer.json", weights):
        if not f.exists():
            raise C.ConfigError(f"run.dir: {f} not found; train first with loom train --run.dir {run_dir}")
    cfg = C.load_toml(d / "config.toml")
    if cfg.model.vocab_size < 1:
        raise C.ConfigError(f"model.vocab_size: {d / 'config.toml'} records {cfg.model.vocab_size}; a trained run "
                            "records its vocabulary")  # fmt: skip
    tok = load_tokenizer(d / "tokenizer.json")
    verify_final(d, weights)
    model = Transformer(cfg.model, cfg.moe)
    try:
        load_model(model, weights)
    except ValueError as e:  # tensors missing or of another shape: config.toml and the weights disagree
        raise CheckpointError(f"{e} (does {d / 'config.toml'} belong to this run?)") from None
    ids = tok.encode(prompt).ids or [0]
    if max(ids) >= cfg.model.vocab_size:
        raise C.ConfigError(f"model.vocab_size: {d / 'tokenizer.json'} gives ids up to {max(ids)}, beyond the model's "
                            f"vocabulary of {cfg.model.vocab_size}; the run's tokenizer.json was replaced")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    out = sample(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, gen)
    return tok.decode(out[0].tolist())
