"""Memory-mapped token windows and a stateless, resumable, layout-independent batch sampler.

The global batch of step ``s`` is a pure function of (seed, s): sequence ``g = s*B + j``
(B = global_batch, j in [0, B)) is window ``perm_e[g mod n]`` of epoch ``e = g // n``
(n windows, ``perm_e`` a seeded permutation). Data-parallel rank r of d takes rows
``[r*B/d, (r+1)*B/d)`` of it, so concatenating the ranks in order gives exactly the
single-process batch, and a run restarted at any step sees the same data.

Every rank needs the same ``perm_e``. Drawing it is O(n) time and 4n or 8n bytes (int32 below 2^31
windows): 1.8·10⁹ windows of a 15T-token corpus at seq 8192 would cost each of 8 ranks per node
7 GB and a minute per epoch. Above ``share_above`` windows (:data:`SHARE_ABOVE`) the first rank of
a node to need it draws it once, under a file lock, into ``<prepared dir>/perm/`` (written whole,
then renamed), and every rank maps that file read-only: per node one draw per epoch and one copy
in the page cache, per rank only the pages of its own rows. The order is ``torch.randperm``'s
either way (int32 and int64 draws give the same order); a read-only directory falls back to a
draw per rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import numpy as np
import torch
from numpy.typing import DTypeLike

from loom.config import ConfigError
from loom.data.prepare import read_meta

# x, y: int64 (micro_batch, seq_len), y = x shifted by one; packed: also positions (micro_batch, seq_len)
Batch = tuple[torch.Tensor, ...]


def packed_positions(x: torch.Tensor, eot: int) -> torch.Tensor:
    """Each token's position in its own document, (B, T) int64: a document starts at the window's
    first token and after every ``eot`` (the end-of-document token belongs to the document it ends).

    position[t] = t - s(t), s(t) = the last start <= t."""
    T = x.shape[1]
    idx = torch.arange(T, device=x.device).expand_as(x)
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = x[:, :-1] == eot
    last = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return (idx - last).contiguous()


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a ``.bin`` token file.

    Window i covers tokens ``[i*seq_len, i*seq_len + seq_len + 1)``; neighbours share one
    token (the last target of one is the first input of the next).
    ``n_windows = (n_tokens - 1) // seq_len``.
    """

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        dtype: DTypeLike | None = None,
        vocab_size: int | None = None,
        pack_eot: int | None = None,
    ) -> None:
        """``dtype`` and ``vocab_size`` default to what the ``meta.json`` beside the file records (uint16
        and no id check without one). Every batch read is checked: an id ``>= vocab_size`` is refused
        naming the file and the token, before it can reach an embedding. ``pack_eot`` (``data.pack``):
        batches are (x, y, positions), documents ending at that token (:func:`packed_positions`)."""
        self.pack_eot = pack_eot
        self.path = Path(path)
        if seq_len < 1:
            raise ConfigError(f"data.seq_len: must be >= 1, got {seq_len}")
        if not self.path.is_file():
            raise ConfigError(f"data.prepared_dir: token file {str(self.path)!r} does not exist")
        meta = self.path.parent / "meta.json"
        if (dtype is None or vocab_size is None) and meta.is_file():
            recorded = read_meta(self.path.parent)
            dtype = dtype if dtype is not None else recorded.get("dtype", "uint16")
            if vocab_size is None and isinstance(recorded.get("vocab_size"), int):
                vocab_size = recorded["vocab_size"]
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        try:
            self.tokens = np.memmap(
                self.path, dtype=np.dtype(dtype if dtype is not None else np.uint16), mode="r"
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"data.prepared_dir: cannot map {self.path} as {dtype} tokens ({e})") from None
        self.n_tokens = len(self.tokens)
        mask_path = self.path.with_name(self.path.stem + ".mask.bin")  # chat / prompt_completion labels
        self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r") if mask_path.is_file() else None
        if self.mask is not None and len(self.mask) != self.n_tokens:
            raise ConfigError(
                f"data.prepared_dir: {mask_path} has {len(self.mask)} bytes for {self.n_tokens} tokens; "
                "prepare the data again"
            )
        self.n_windows = (self.n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(
                f"data.seq_len: {self.path.name} has {self.n_tokens} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; lower data.seq_len or use a larger corpus"
            )

    def __len__(self) -> int:
        return self.n_windows

    def window(self, i: int) -> torch.Tensor:
        """Tokens ``[i*seq_len, (i+1)*seq_len]`` as int64, shape (seq_len + 1,)."""
        if not 0 <= i < self.n_windows:
            raise IndexError(f"window {i} out of range [0, {self.n_windows})")
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    __getitem__ = window

    def batch(self, indices: list[int]) -> Batch:
        """Stack windows into (x, y), each of shape (len(indices), seq_len)."""
        tokens = torch.stack([self.window(i) for i in indices])  # (b, T+1)
        if self.vocab_size is not None and tokens.numel() and int(tokens.max()) >= self.vocab_size:
            row, col = torch.nonzero(tokens >= self.vocab_size)[0].tolist()
            pos = indices[row] * self.seq_len + col
            raise ConfigError(
                f"data.prepared_dir: {self.path} holds token id {int(tokens[row, col])} at token {pos}, "
                f"outside the tokenizer's vocabulary of {self.vocab_size}; the file was altered: delete "
                "its directory and prepare again"
            )
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.mask is not None:  # targets outside assistant turns / completions are not trained on
            m = np.stack(
                [self.mask[i * self.seq_len + 1 : i * self.seq_len + self.seq_len + 1] for i in indices]
            )
            y = y.masked_fill(torch.from_numpy(m == 0), -100)
        return (x, y) if self.pack_eot is None else (x, y, packed_positions(x, self.pack_eot))


def epoch_permutation(n: int, seed: int, epoch: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.randperm(n)`` from a generator seeded by a hash of (seed, epoch) (the same order in
    int32 and int64)."""
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)
    g = torch.Generator().manual_seed(int(state[0]))
    return torch.randperm(n, generator=g, dtype=dtype)


SHARE_ABOVE = 1 << 23  # windows (32 MB of int32): above, a node draws each epoch's order once


def shared_permutation(n: int, seed: int, epoch: int, cache: Path) -> np.ndarray:
    """:func:`epoch_permutation` as a read-only map of ``cache/perm-n<n>-s<seed>-e<epoch>.<dtype>``,
    drawn by the first process to get ``cache/.lock`` (see the module doc); a draw of its own if
    ``cache`` cannot be written."""
    small = n < 2**31
    dtype, tdtype = (np.int32, torch.int32) if small else (np.int64, torch.int64)
    path = cache / f"perm-n{n}-s{seed}-e{epoch}.{np.dtype(dtype).name}"
    size = n * np.dtype(dtype).itemsize

    def ready() -> bool:
        return path.is_file() and path.stat().st_size == size

    try:
        if not ready():
            cache.mkdir(parents=True, exist_ok=True)
            with open(cache / ".lock", "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not ready():
                    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
                    try:
                        epoch_permutation(n, seed, epoch, tdtype).numpy().tofile(tmp)
                        os.replace(tmp, path)
                    finally:
                        with contextlib.suppress(OSError):
                            tmp.unlink()
        return np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    except OSError:
        return epoch_permutation(n, seed, epoch, tdtype).numpy()


class BatchSampler:
    """This rank's micro-batches of any step, computed from (seed, step) alone (see module doc)."""

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        share_above: int = SHARE_ABOVE,
    ) -> None:
        """``share_above``: above this many windows each epoch's order is drawn once per node into
        ``<dataset dir>/perm/`` and mapped (:func:`shared_permutation`), else drawn by each rank."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"parallel.dp: rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_batch < 1 or global_batch < 1:
            raise ValueError(
                f"train.global_batch/micro_batch: must be >= 1, got {global_batch}/{micro_batch}"
            )
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"train.global_batch: {global_batch} must be divisible by micro_batch*dp = "
                f"{micro_batch}*{dp_size} = {micro_batch * dp_size}"
            )
        if seed < 0:
            raise ValueError(f"train.seed: must be >= 0, got {seed}")
        self.dataset = dataset
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.rows_per_rank = global_batch // dp_size
        self.n_micro = self.rows_per_rank // micro_batch  # gradient-accumulation steps
        self.share_above = share_above
        self._perms: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.dataset.n_windows / self.global_batch

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most two epochs (or many, for tiny sets)
                self._perms.clear()
            n = self.dataset.n_windows
            self._perms[epoch] = (
                shared_permutation(n, self.seed, epoch, self.dataset.path.parent / "perm")
                if n > self.share_above
                else epoch_permutation(n, self.seed, epoch).numpy()
            )
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """Window indices of this rank's rows of ``step``, in order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.dataset.n_windows
        first = step * self.global_batch + self.dp_rank * self.rows_per_rank
        return [int(self._perm(g // n)[g % n]) for g in range(first, first + self.rows_per_rank)]

    def micro_batches(self, step: int) -> list[Batch]:
        """``global_batch / (dp_size * micro_batch)`` pairs (x, y), each int64 (micro_batch, seq_len)."""
        idx = self.indices(step)
        mb = self.micro_batch
        return [self.dataset.batch(idx[i : i + mb]) for i in range(0, len(idx), mb)]


PHI = (5**0.5 - 1) / 2  # fractional part of the golden ratio


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 values: a seeded hash, vectorized (wraps modulo 2^64)."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class MixtureSampler(BatchSampler):
    """Batches mixing several sources by weight, a pure function of (seed, step) like
    :class:`BatchSampler` (same rank slicing, so any layout sees the same global batch).

    Sequence g comes from source k with C_k <= u_g < C_{k+1} (C: cumulative normalized weights), where
    u_g = frac(o + φ·g) (o from the seed, φ the golden ratio's fraction): a low-discrepancy sequence,
    so over any n consecutive sequences each source's count is within O(log n) of weight·n. Its window
    is hash(seed, g) mod that source's windows (drawn with replacement).
    """

    def __init__(
        self,
        datasets: list[TokenDataset],
        weights: list[float],
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(datasets[0], global_batch, micro_batch, dp_rank, dp_size, seed)
        if len(weights) != len(datasets) or not all(w > 0 for w in weights):
            raise ValueError(f"data.sources: need one positive weight per source, got {weights}")
        self.datasets = datasets
        self.cum = np.cumsum(np.asarray(weights, dtype=np.float64) / sum(weights))
        self.offset = float(mix64(np.array([seed], dtype=np.uint64))[0] >> np.uint64(11)) / 2**53

    def sources_of(self, g: np.ndarray) -> np.ndarray:
        """Source index of global sequences ``g``."""
        u = np.mod(self.offset + PHI * g.astype(np.float64), 1.0)
        return np.minimum(np.searchsorted(self.cum, u, side="right"), len(self.datasets) - 1)

    def picks(self, step: int) -> list[tuple[int, int]]:
        """(source, window) of this rank's rows of ``step``."""
        first = step * self.global_batch + self.dp_rank * self.rows_per_rank
        g = np.arange(first, first + self.rows_per_rank, dtype=np.int64)
        src = self.sources_of(g)
        h = mix64(g.astype(np.uint64) ^ mix64(np.array([self.seed + 1], dtype=np.uint64)))
        sizes = np.array([d.n_windows for d in self.datasets], dtype=np.uint64)
        return [(int(k), int(w)) for k, w in zip(src, h % sizes[src])]

    def realized(self, steps: int) -> np.ndarray:
        """Share of each source among the global sequences of steps [0, steps)."""
        counts = np.bincount(
            self.sources_of(np.arange(steps * self.global_batch)), minlength=len(self.datasets)
        )
        return counts / max(1, counts.sum())

    def micro_batches(self, step: int) -> list[Batch]:
        picks, mb = self.picks(step), self.micro_batch
        rows = [self.datasets[k].batch([w]) for k, w in picks]
        return [tuple(torch.cat(parts) for parts in zip(*rows[i : i + mb])) for i in range(0, len(rows), mb)]


def eval_batches(
    dataset: TokenDataset, n_batches: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1
) -> list[Batch]:
    """Fixed eval micro-batches of this rank: the first windows of ``dataset``, dealt round-robin.

    ``n_batches`` is the global count; it is rounded up to a multiple of ``dp_size`` so every
    rank runs the same number of forwards (collectives stay matched). Global micro-batch k holds
    windows ``(k*micro_batch + i) mod n_windows`` (wrapping on a small set) and goes to rank
    ``k mod dp_size``; whenever dp_size divides n_batches the union over ranks is the dp=1 set.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"parallel.dp: rank {dp_rank} is not in [0, dp_size={dp_size})")
    if n_batches < 1 or micro_batch < 1:
        raise ValueError(f"train.eval_batches/micro_batch: must be >= 1, got {n_batches}/{micro_batch}")
    per_rank = -(-n_batches // dp_size)
    n = dataset.n_windows
    out = []
    for i in range(per_rank):
        k = i * dp_size + dp_rank
        out.append(dataset.batch([(k * micro_batch + r) % n for r in range(micro_batch)]))
    return out
