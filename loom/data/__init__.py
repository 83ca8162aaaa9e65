"""Data: corpus reading, byte-level BPE tokenizer, prepared token files, memmap dataset, sampler.

The names below are imported on first use (PEP 562), so importing a light module of the package
(:mod:`loom.data.report`, used by the command line before it validates a config) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.data.dataset import BatchSampler, TokenDataset, eval_batches
    from loom.data.mixture import MixtureSampler, mixture_sampler
    from loom.data.prepare import PreparedData, prepare_data, prepare_sources
    from loom.data.tokenizer import load_tokenizer

_MODULE = {
    "BatchSampler": "dataset",
    "TokenDataset": "dataset",
    "eval_batches": "dataset",
    "MixtureSampler": "mixture",
    "mixture_sampler": "mixture",
    "PreparedData": "prepare",
    "prepare_data": "prepare",
    "prepare_sources": "prepare",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "BatchSampler",
    "MixtureSampler",
    "PreparedData",
    "TokenDataset",
    "eval_batches",
    "load_tokenizer",
    "mixture_sampler",
    "prepare_data",
    "prepare_sources",
]


def __getattr__(name: str) -> Any:
    if name in _MODULE:
        value = getattr(importlib.import_module(f"loom.data.{_MODULE[name]}"), name)
        globals()[name] = value  # once: later lookups (and monkeypatching) see a plain attribute
        return value
    raise AttributeError(f"module 'loom.data' has no attribute {name!r}")
