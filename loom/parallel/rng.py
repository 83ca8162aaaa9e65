"""Dropout randomness on sharded activations: one stream shared by a group, one per rank.

Activations *replicated* over a group (hidden states under tensor parallelism without sequence
parallelism) must drop the same elements on every rank, or the replicas drift apart: they use
the default generator, which every rank seeds alike (``train.seed``) and advances alike.
Activations *split* over a group (each tp rank's attention heads; each rank's sequence shard
with sp or context parallelism) need independent masks, or every rank repeats the others'
pattern. :func:`private_rng` gives them that, as Megatron's model-parallel RNG does, but without
state of its own:

    draw = one 62-bit integer from the default CPU generator   (advances it alike on every rank)
    seed = (draw + (rank + 1) * GOLDEN) mod 2**63               (distinct per rank)

and the region runs on a forked generator seeded with ``seed``; on leaving, the default
generators are as they were after the draw. Regions nest (tp's inside cp's). Activation
recomputation restores the default generator before replaying a region
(``preserve_rng_state``), so it replays the same draw and the same masks: recomputed gradients
stay bitwise equal to stored ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: rank offsets far apart in seed space


def rank_seed(draw: int, rank: int) -> int:
    """The seed of ``rank``'s region for one ``draw`` (module formula)."""
    return (draw + (rank + 1) * GOLDEN) % 2**63


@contextlib.contextmanager
def private_rng(rank: int, device: torch.device | str = "cpu", enabled: bool = True) -> Iterator[None]:
    """Run the block on a generator private to ``rank`` of its group (module doc); no-op if not ``enabled``."""
    if not enabled:
        yield
        return
    device = torch.device(device)
    draw = int(
        torch.randint(0, 2**62, (1,), device="cpu").item()
    )  # the default CPU generator, whatever the default device
    seed = rank_seed(draw, rank)
    accel = device.type != "cpu"
    index = device.index if device.index is not None else 0
    with torch.random.fork_rng(devices=[index] if accel else [], device_type=device.type if accel else None):
        torch.default_generator.manual_seed(seed)
        if accel:
            torch.get_device_module(device.type).manual_seed(seed)  # the current device's generator
        yield
