"""Data: corpus reading, byte-level BPE tokenizer, prepared token files, memmap dataset, sampler."""

from loom.data.dataset import BatchSampler, TokenDataset, eval_batches
from loom.data.mixture import MixtureSampler, mixture_sampler
from loom.data.prepare import PreparedData, prepare_data, prepare_sources
from loom.data.tokenizer import load_tokenizer

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
