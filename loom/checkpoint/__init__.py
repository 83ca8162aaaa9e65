"""Sharded, verified, layout-independent checkpoints.

- :mod:`~loom.checkpoint.protocol`  the resharding contract strategies implement
- :mod:`~loom.checkpoint.format`    safetensors shards + JSON index/train state (no pickle)
- :mod:`~loom.checkpoint.integrity` SHA-256 manifest, checked (split over the ranks) before anything is applied
- :mod:`~loom.checkpoint.save`      atomic, collective, optionally asynchronous saves
- :mod:`~loom.checkpoint.load`      find ``latest``, read any region into any layout
- :mod:`~loom.checkpoint.shared_read` replicated pieces: 1/n read per replica, then all-gathered
- :mod:`~loom.checkpoint.convert`   consolidated single-file export
- :mod:`~loom.checkpoint.training`  what the trainer saves and restores (state, RNG, data position)
- :mod:`~loom.checkpoint.recorded`  the model a checkpoint recorded against the config at hand (resume, generate)
"""

from loom.checkpoint.format import CheckpointError
from loom.checkpoint.load import CheckpointReader, find
from loom.checkpoint.protocol import Box, Flat, Shardable, ShardedTensor, ShardReader
from loom.checkpoint.replicated import Placement, placement_state
from loom.checkpoint.save import Checkpointer

__all__ = [
    "Box",
    "CheckpointError",
    "CheckpointReader",
    "Checkpointer",
    "Flat",
    "Placement",
    "ShardReader",
    "Shardable",
    "ShardedTensor",
    "find",
    "placement_state",
]
