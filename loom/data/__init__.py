"""Data: corpus reading, byte-level BPE tokenizer, prepared token files, memmap dataset, sampler."""

from loom.data.dataset import BatchSampler, TokenDataset, eval_batches
from loom.data.prepare import PreparedData, prepare_data
from loom.data.tokenizer import load_tokenizer

__all__ = ["BatchSampler", "PreparedData", "TokenDataset", "eval_batches", "load_tokenizer", "prepare_data"]
