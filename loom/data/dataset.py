"""Memory-mapped token windows and a stateless, resumable, layout-independent batch sampler.

The global batch of step ``s`` is a pure function of (seed, s): sequence ``g = g0 + (s - s0)*B + j``
(B = global_batch, j in [0, B); (s0, g0) the resume point, (0, 0) for a fresh run) is window
``perm_e[g mod n]`` of epoch ``e = g // n`` (n windows, ``perm_e`` a seeded permutation). Data-parallel
rank r of d takes rows ``[r*B/d, (r+1)*B/d)`` of it, so concatenating the ranks in order gives exactly
the single-process batch, whatever d and however each rank cuts its rows into micro-batches.

The data position a checkpoint keeps (:meth:`BatchSampler.position`) is ``g``, the count of global
sequences consumed, with each source's count and epoch, the seed and the sources' identity. A resume
(:meth:`BatchSampler.resume`) sets ``(s0, g0)`` to it, so the next sequence is the first unseen one
even when ``train.global_batch`` changed; with the same B it is exactly the uninterrupted run's.

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
import logging
import os
from pathlib import Path

import numpy as np
import torch
from numpy.typing import DTypeLike

from loom.config import ConfigError
from loom.data.prepare import read_meta

log = logging.getLogger("loom")

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


def check_one_window(path: Path, n_tokens: int, seq_len: int) -> None:
    """A token file must hold at least one window of ``seq_len`` + 1 tokens (checked by the launcher
    from the prepared data's record before any rank starts, and by each rank as it maps the file)."""
    if (n_tokens - 1) // seq_len < 1:
        raise ConfigError(
            f"data.seq_len: {path} has {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "lower data.seq_len or use a larger corpus"
            + (
                " (or raise data.val_fraction: the held-out split is this small)"
                if path.name.startswith("val")
                else ""
            )
        )


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
        recorded = read_meta(self.path.parent) if meta.is_file() else {}
        digests = recorded.get("sha256")
        # the token file's SHA-256 recorded at prepare time ("" unknown): its identity in a data position
        self.digest = str(digests.get(self.path.name, "")) if isinstance(digests, dict) else ""
        if dtype is None or vocab_size is None:
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
        check_one_window(self.path, self.n_tokens, seq_len)
        self.n_windows = (self.n_tokens - 1) // seq_len
        self._mapped = [  # (path, its mapping, the (device, inode) mapped): _check_size
            (p, a, (os.stat(p).st_dev, os.stat(p).st_ino))
            for p, a in ((self.path, self.tokens), (mask_path, self.mask))
            if a is not None
        ]

    def __len__(self) -> int:
        return self.n_windows

    def window(self, i: int) -> torch.Tensor:
        """Tokens ``[i*seq_len, (i+1)*seq_len]`` as int64, shape (seq_len + 1,)."""
        if not 0 <= i < self.n_windows:
            raise IndexError(f"window {i} out of range [0, {self.n_windows})")
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    __getitem__ = window

    def _check_size(self) -> None:
        """The mapped files still hold every token: one truncated in place under the run would end this
        process with SIGBUS at the first read past its new end, with no line naming it (a file deleted or
        replaced by another leaves the mapping its old one: nothing to say)."""
        for path, mapped, inode in self._mapped:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == inode and st.st_size < mapped.nbytes:
                    raise ConfigError(
                        f"data.prepared_dir: {path} shrank to {st.st_size} bytes under the run (it held "
                        f"{mapped.nbytes}); it was truncated in place: prepare the data again"
                    )

    def batch(self, indices: list[int]) -> Batch:
        """Stack windows into (x, y), each of shape (len(indices), seq_len)."""
        self._check_size()
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


def window_order(dataset: TokenDataset, seed: int, epoch: int, share_above: int = SHARE_ABOVE) -> np.ndarray:
    """Epoch ``epoch``'s order of ``dataset``'s windows: :func:`epoch_permutation`, shared per node
    (:func:`shared_permutation` under ``<dataset dir>/perm/``) above ``share_above`` windows."""
    n = dataset.n_windows
    if n > share_above:
        return shared_permutation(n, seed, epoch, dataset.path.parent / "perm")
    return epoch_permutation(n, seed, epoch).numpy()


class BatchSampler:
    """This rank's micro-batches of any step, computed from (seed, step) and the resume point alone
    (see module doc)."""

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
        self.origin = (0, 0)  # (s0, g0): step s0 starts at global sequence g0 (a fresh run: (0, 0))
        self._perms: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.dataset.n_windows / self.global_batch

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most two epochs (or many, for tiny sets)
                self._perms.clear()
            self._perms[epoch] = window_order(self.dataset, self.seed, epoch, self.share_above)
        return self._perms[epoch]

    def first_sequence(self, step: int) -> int:
        """Global index of the first sequence of ``step``: ``g0 + (step - s0)·B``."""
        s0, g0 = self.origin
        if step < s0:
            raise ValueError(f"step {step} is before this sampler's resume point, step {s0}")
        return g0 + (step - s0) * self.global_batch

    def _first_row(self, step: int) -> int:
        """Global index of this rank's first row of ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.first_sequence(step) + self.dp_rank * self.rows_per_rank

    def indices(self, step: int) -> list[int]:
        """Window indices of this rank's rows of ``step``, in order."""
        n = self.dataset.n_windows
        first = self._first_row(step)
        return [int(self._perm(g // n)[g % n]) for g in range(first, first + self.rows_per_rank)]

    def sample_ids(self, step: int) -> np.ndarray:
        """(source, window) of each of this rank's rows of ``step``, int64 (rows, 2); one source: 0."""
        w = np.asarray(self.indices(step), dtype=np.int64)
        return np.stack([np.zeros_like(w), w], axis=1)

    def micro_batches(self, step: int) -> list[Batch]:
        """``global_batch / (dp_size * micro_batch)`` pairs (x, y), each int64 (micro_batch, seq_len)."""
        idx = self.indices(step)
        mb = self.micro_batch
        return [self.dataset.batch(idx[i : i + mb]) for i in range(0, len(idx), mb)]

    # ------------------------------------------------------------------ data position

    def sources(self) -> list[dict]:
        """Each source's identity: its directory, token file SHA-256, window count and normalized weight."""
        d = self.dataset
        return [{"name": str(d.path.parent), "sha256": d.digest, "windows": d.n_windows, "weight": 1.0}]

    def consumed(self, g: int) -> list[int]:
        """Sequences drawn from each source among global sequences ``[0, g)``."""
        return [g]

    def position(self, step: int) -> dict:
        """The data position before ``step`` (JSON): global sequences consumed, the seed, and each
        source's identity, consumed count and epoch (consumed // windows). Windows are fixed slices
        of the token stream (a packed document that overflows one window continues in the next
        window, not in a buffer), so no packing carry-over exists to save."""
        g = self.first_sequence(step)
        sources = [
            src | {"consumed": c, "epoch": c // src["windows"]}
            for src, c in zip(self.sources(), self.consumed(g))
        ]
        return {
            "step": step,
            "global_sequences": g,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "seq_len": self.dataset.seq_len,
            "packing": "windows",
            "sources": sources,
        }

    def resume(self, saved: dict, step: int, where: str = "the checkpoint") -> None:
        """Continue from a checkpoint's :meth:`position` at ``step``: step ``step`` starts at its
        ``global_sequences`` (an older record without them: ``step`` · its global batch), whatever
        this run's global batch. Sources other than the saved ones (paths' data, count, weights)
        are refused in one line naming ``where``."""
        old_b = saved.get("global_batch")
        g = saved.get("global_sequences")
        if not isinstance(g, int):
            g = step * (old_b if isinstance(old_b, int) and old_b > 0 else self.global_batch)
        if isinstance(saved.get("sources"), list):
            self._check_sources(saved["sources"], where)
        self.origin = (step, g)
        self._restored(saved, g)
        if isinstance(old_b, int) and old_b != self.global_batch:
            log.info(
                "train.global_batch %d -> %d: step %d continues at global sequence %d, the first unseen",
                old_b,
                self.global_batch,
                step,
                g,
            )

    def _restored(self, saved: dict, g: int) -> None:
        """Hook for per-source counters (mixtures)."""

    def _check_sources(self, saved: list, where: str) -> None:
        now = self.sources()

        def same(a: dict, b: dict) -> bool:
            digests = a.get("sha256") and b.get("sha256")
            return (
                a.get("windows") == b.get("windows")
                and (not digests or a["sha256"] == b["sha256"])
                and abs(float(a.get("weight", 1.0)) - float(b.get("weight", 1.0))) < 1e-9
            )

        if len(saved) == len(now) == 1 and not same(saved[0], now[0]):  # as run.dir/data.json words it
            was, new = (str(x.get("sha256", "")) or "?" for x in (saved[0], now[0]))
            raise ConfigError(
                f"data: {where} was trained with train.bin {was[:12]}, this run's is {new[:12]}; "
                f"{saved[0].get('windows')} windows then, {now[0].get('windows')} now: resume with the same "
                f"data and tokenizer, or start a new run.dir with --train.init_from {where}"
            )
        if len(saved) != len(now) or not all(same(a, b) for a, b in zip(saved, now)):
            raise ConfigError(
                f"data.sources: {where} was saved reading {_describe(saved)}; this run reads {_describe(now)}: "
                "the data position would not continue the same samples. Resume with the same sources "
                f"and weights, or start a new run.dir with --train.init_from {where}"
            )


def _describe(sources: list) -> str:
    """``n source(s): dir (weight w, N windows, sha256 abc…), ...``."""
    parts = [
        f"{s.get('name', '?')} (weight {float(s.get('weight', 1.0)):.4g}, {s.get('windows')} windows, "
        f"sha256 {str(s.get('sha256', ''))[:12] or '?'})"
        for s in sources
    ]
    return f"{len(sources)} source{'s' if len(sources) != 1 else ''}: " + ", ".join(parts)


def eval_batches(
    dataset: TokenDataset, n_batches: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1
) -> list[Batch]:
    """Fixed eval micro-batches of this rank: the first windows of ``dataset``, dealt round-robin.

    ``n_batches`` is the global count. Global micro-batch k holds windows ``(k*micro_batch + i) mod
    n_windows`` (wrapping on a small set) and goes to rank ``k mod dp_size``; so every rank runs the
    same number of forwards (collectives stay matched) the last ones are padded up to a multiple of
    ``dp_size`` with batches whose targets are all -100, which the token mean weighs by zero: the
    union over ranks is the dp=1 set on any dp (rounded up, dp4 evaluated 4 batches where one process
    evaluated 2, and the eval loss moved by 2e-3).
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
        x, y, *rest = dataset.batch([(k * micro_batch + r) % n for r in range(micro_batch)])
        out.append((x, y if k < n_batches else torch.full_like(y, -100), *rest))
    return out
