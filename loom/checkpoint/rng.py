"""Random number generator states as JSON (base64 bytes and integer lists, never pickle).

Every rank saves its own: torch CPU generator, Python ``random``, NumPy's global generator,
and every CUDA device's generator when CUDA is initialised. Restoring them makes dropout or
any sampling after a resume draw exactly what the uninterrupted run drew.

In a checkpoint, rank r's states are one uint8 tensor ``train.rng.rank-<r>`` (the JSON's UTF-8
bytes, about 20 KB; :func:`rng_name`, :func:`rng_tensor`) in the shard file rank r writes, so on
resume rank r reads its own states only (R bytes from the file it opens anyway), where a list of
every rank's states in ``train_state.json`` made every rank read world · R bytes (330 MB at 16k
ranks). They are hashed and verified with the shards; exports take ``model.*`` only.
"""

from __future__ import annotations

import base64
import json
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict:
    """This process's generator states, JSON-serialisable."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    if isinstance(np_state, dict):  # only when the global generator is not the legacy MT19937
        raise TypeError("NumPy's global generator is not MT19937: its state has no legacy tuple form")
    name, keys, pos, has_gauss, cached = np_state
    out = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "python": {"version": version, "state": list(state), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict) -> None:
    """Set this process's generators from :func:`capture_rng` output."""
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["name"],
            np.array(npst["keys"], dtype=np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        states = [_unb64(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


RNG_PREFIX = "train.rng.rank-"


def rng_name(rank: int) -> str:
    """The checkpoint name of rank ``rank``'s generator states."""
    return f"{RNG_PREFIX}{rank:05d}"


def rng_tensor(state: dict) -> torch.Tensor:
    """:func:`capture_rng` output as a uint8 tensor (its JSON, UTF-8)."""
    return torch.frombuffer(bytearray(json.dumps(state, sort_keys=True).encode()), dtype=torch.uint8).clone()


def rng_from_tensor(t: torch.Tensor) -> dict:
    """The inverse of :func:`rng_tensor`."""
    return json.loads(bytes(t.to(torch.uint8).numpy().tobytes()).decode())
