"""A training mixture from ``[[data.sources]]``: each source's prepared tokens and the weighted sampler."""

from __future__ import annotations

import logging

from loom.config import LoomConfig
from loom.data.dataset import MixtureSampler, TokenDataset
from loom.data.prepare import prepare_sources

log = logging.getLogger("loom")


def mixture_sampler(cfg: LoomConfig, dp_rank: int, dp: int, pack_eot: int | None = None) -> MixtureSampler:
    """The :class:`MixtureSampler` over every source's ``train.bin``; logs each source's token count,
    its weight and the share of sequences it gets over the run's ``train.steps`` (the realized mixture)."""
    prepared = prepare_sources(cfg.data, progress=False)
    sets = [TokenDataset(p.train_path, cfg.data.seq_len, pack_eot=pack_eot) for p in prepared]
    weights = [s.weight for s in cfg.data.sources]
    sampler = MixtureSampler(
        sets, weights, cfg.train.global_batch, cfg.train.micro_batch, dp_rank, dp, cfg.train.seed
    )
    realized = sampler.realized(cfg.train.steps)
    for i, (src, p, share) in enumerate(zip(cfg.data.sources, prepared, realized)):
        log.info(
            "mixture source %d %s: %s train tokens, weight %.3f, realized %.4f of %d sequences",
            i,
            src.path,
            f"{p.n_train_tokens:,}",
            src.weight / sum(weights),
            share,
            cfg.train.steps * cfg.train.global_batch,
        )
    return sampler
