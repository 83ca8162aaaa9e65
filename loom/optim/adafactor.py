"""Adafactor (Shazeer & Stern 2018) on flat parameter shards: ``torch.optim.Adafactor``'s math,
with the factored statistics made whole across ZeRO shards and tensor-parallel ranks.

For a matrix parameter P (R × C) with gradient G at step t (lr γ, decay λ, β̂ₜ = t^c, c = -0.8,
ε₁ = fp32 machine epsilon, ε₂ = 10⁻³, clip threshold d = 1), exactly as ``torch.optim.Adafactor``:

    ρₜ = min(γ, 1/√t),   α = max(ε₂, RMS(P)) · ρₜ            (relative step size)
    P ← P · (1 - γλ)                                          (matrices only, as AdamW's groups)
    r ← lerp(r, mean_j G²ᵢⱼ, β̂ₜ)   (R)     c ← lerp(c, mean_i G²ᵢⱼ, β̂ₜ)   (C)
    V̂ = r cᵀ / max(mean(r), ε₁)     U = G / sqrt(max(V̂, ε₁²))
    P ← P - α / max(1, RMS(U)/d) · U

Vectors keep an unfactored v ← lerp(v, G², β̂ₜ). State: 4·(R + C) bytes per matrix instead of
Adam's 8·R·C, and 4 bytes per vector element (+ a 4-byte fp32 master per element when the
parameters are half precision).

Shards. A ZeRO shard cuts a matrix at arbitrary element boundaries, so a rank holds a run of
whole and partial rows. The statistics are sums, so each rank computes *partial* row sums,
column sums, Σ P² and (later) Σ U² over the elements it holds, and one all-reduce over the
sharding group makes them whole; tensor-parallel shards add theirs over tp for the dimension
tp splits (rows split: column sums, mean(r); columns split: row sums; both: Σ P², Σ U²). Every
rank holding a piece of a matrix then keeps its full r and c (4·(R + C) bytes, replicated on
those ranks: the statistics are tiny, the element-wise state is what ZeRO shards). Per step that
adds an all-reduce of Σ over matrices of (R + C + 1) + one float per vector, and one float per
parameter for RMS(U), in float64 (so that one rank's sums equal torch's fp32 norms exactly).

    state bytes on a rank = Σ_{matrices it touches} 4(R + C) + 4·(its vector elements)
                            [+ 4·(shard elements) of fp32 masters for half parameters]

Matrices only (ndim <= 2): torch factors the last two dims of higher-rank tensors; the model has none.

A padded vocabulary (``model.pad_vocab_to``, or tp padding it to a multiple of 128·tp): the embedding
and head hold V' > V rows, the V' - V padded ones zeros that no gradient reaches. The statistics count
the V real rows only (the layout's ``Slot.rows``): c = Σ_i G²ᵢⱼ / V, mean(r) = Σ_i rᵢ / V, RMS over V·C
elements, so a padded matrix steps as the unpadded one (its padded rows stay zero: U = 0 there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom import comm
from loom.comm import Group
from loom.optim.master import MasterWeights
from loom.optim.store import StateStore

BETA2_DECAY, EPS2, CLIP_D = -0.8, 1e-3, 1.0


@dataclass(frozen=True)
class Piece:
    """The run of one parameter inside this rank's shard of a flat buffer.

    ``lo, hi``: elements of the parameter's own flattening; ``a, b``: the same run in the shard.
    """

    shard: int  # index of the flat buffer / shard
    slot: int  # index of the parameter in its layout
    param: torch.Tensor
    lo: int
    hi: int
    a: int
    b: int
    decay: bool
    tp_dim: int | None  # tensor-parallel shard dim of the parameter, None if replicated over tp


def pieces_of(layouts: Sequence) -> tuple[list[Piece], list[tuple[int, int]]]:
    """This rank's pieces, and (layout, slot) of *every* parameter of the layouts, in the same
    order on every rank (collectives pack per-parameter statistics in this order)."""
    pieces, every = [], []
    for i, lay in enumerate(layouts):
        for j, (p, s) in enumerate(zip(lay.params, lay.slots)):
            every.append((i, j))
            lo, hi = max(s.offset, lay.start), min(s.offset + s.numel, lay.end)
            if lo < hi:
                tp_dim = s.tp_dim
                pieces.append(
                    Piece(
                        i, j, p, lo - s.offset, hi - s.offset, lo - lay.start, hi - lay.start, s.decay, tp_dim
                    )
                )
    return pieces, every


def _factored(p: torch.Tensor) -> bool:
    if p.dim() > 2:
        raise ValueError(f"Adafactor: parameters of ndim > 2 are not supported (shape {tuple(p.shape)})")
    return p.dim() == 2


class FlatAdafactor:
    """Adafactor over flat shards (see module docstring); ``bind_groups`` before the first step
    when the shards are split over a sharding group or parameters over tp."""

    def __init__(
        self, layouts: Sequence, shards: Sequence[torch.Tensor], store: StateStore, weight_decay: float = 0.0
    ) -> None:
        self.master = MasterWeights(shards, store)
        self.params, self.masters, self.store = self.master.params, self.master.masters, store
        self.weight_decay = weight_decay
        self.step_count = 0
        self.eps1 = torch.finfo(torch.float32).eps
        self.shard_group: Group = None
        self.tp_group: Group = None
        # statistics may live in host memory (offload); collectives run on the parameters' device
        self._comm_device = shards[0].device if len(shards) else store.device
        self.pieces, every = pieces_of(layouts)
        # Offsets of every parameter's statistics in the packed buffer: [row sums, col sums, Σ P²].
        self._stat_at: dict[tuple[int, int], int] = {}
        self._tp_dims: list[int | None] = []
        self._stat_len = 0
        self._tp_mask: list[tuple[int, int]] = []
        self._real_rows: dict[tuple[int, int], int | None] = {}  # a padded vocabulary's V (Slot.rows)
        for i, j in every:
            p = layouts[i].params[j]
            self._stat_at[(i, j)] = self._stat_len
            R, C = (p.shape[0], p.shape[1]) if _factored(p) else (0, 0)
            dim = layouts[i].slots[j].tp_dim
            self._real_rows[(i, j)] = layouts[i].slots[j].rows
            if dim is not None:  # entries tp must sum: the unsplit axis' sums, and Σ P²
                if R:
                    self._tp_mask.append(
                        (self._stat_len + R, self._stat_len + R + C)
                        if dim == 0
                        else (self._stat_len, self._stat_len + R)
                    )
                self._tp_mask.append((self._stat_len + R + C, self._stat_len + R + C + 1))
            self._tp_dims.append(dim)
            self._stat_len += R + C + 1
        self._param_index = {ij: k for k, ij in enumerate(every)}
        self._means: dict[int, torch.Tensor] = {}  # mean(r) of the last step, by piece (for checkpoints)
        self._ckpt: dict[int, torch.Tensor] = {}  # V̂ buffers handed to a checkpoint, by shard
        self.row_var: dict[int, torch.Tensor] = {}
        self.col_var: dict[int, torch.Tensor] = {}
        self.variance: dict[int, torch.Tensor] = {}
        for n, pc in enumerate(self.pieces):
            if _factored(pc.param):
                self.row_var[n] = store.zeros(pc.param.shape[0], f"row_var{n}")
                self.col_var[n] = store.zeros(pc.param.shape[1], f"col_var{n}")
            else:
                self.variance[n] = store.zeros(pc.hi - pc.lo, f"variance{n}")

    comm_device: torch.device | None = None  # set by a strategy whose shards live in host memory

    def bind_groups(self, shard_group: Group, tp_group: Group) -> None:
        """The groups whose ranks hold other pieces of the same parameters."""
        self.shard_group, self.tp_group = shard_group, tp_group

    @property
    def state_bytes(self) -> int:
        """Row/column statistics, vector variances and fp32 masters, wherever they live."""
        return self.store.nbytes

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def checkpoint_buffers(self, i: int) -> list[tuple[str, torch.Tensor]]:
        """Shard i's second-moment estimate V̂ = r cᵀ / mean(r) (vectors: v), element-shaped, saved as
        ``exp_avg_sq`` like AdamW's (so checkpoints reshard with the parameters). It determines the
        factors again: mean(r) = mean(c) (both EMAs of the mean of G²), so r_i = Σ_j V̂_ij / C and
        c_j = Σ_i V̂_ij / R (:meth:`checkpoint_loaded`). The buffer lives until the next step."""
        if i in self._ckpt:  # asked once per parameter of the shard: one buffer
            return [("exp_avg_sq", self._ckpt[i])]
        buf = torch.zeros(self.masters[i].numel(), dtype=torch.float32, device=self.store.device)
        for n, pc in enumerate(self.pieces):
            if pc.shard != i:
                continue
            if n in self.variance:
                buf[pc.a : pc.b] = self.variance[n]
                continue
            C = pc.param.shape[1]
            r0, r1 = pc.lo // C, (pc.hi - 1) // C + 1
            mean = self._means.get(n)
            if mean is not None and float(mean) > 0:
                v = (self.row_var[n][r0:r1, None] @ self.col_var[n][None, :]).div_(mean)
                buf[pc.a : pc.b] = v.view(-1)[pc.lo - r0 * C : pc.hi - r0 * C]
        self._ckpt[i] = buf
        return [("exp_avg_sq", buf)]

    @torch.no_grad()
    def checkpoint_loaded(self) -> None:
        """Rebuild r, c and v from the filled V̂ buffers (collective over the sharding group and tp)."""
        stats = torch.zeros(self._stat_len, dtype=torch.float64, device=self.store.device)
        for n, pc in enumerate(self.pieces):
            v = self._ckpt[pc.shard][pc.a : pc.b]
            if n in self.variance:
                self.variance[n].copy_(v)
                continue
            R, C = pc.param.shape
            at = self._stat_at[(pc.shard, pc.slot)]
            r0, r1 = pc.lo // C, (pc.hi - 1) // C + 1
            pad = torch.zeros((r1 - r0) * C, dtype=torch.float64, device=v.device)
            pad[pc.lo - r0 * C : pc.hi - r0 * C] = v
            pad = pad.view(r1 - r0, C)
            stats[at + r0 : at + r1] = pad.sum(dim=1)
            stats[at + R : at + R + C] = pad.sum(dim=0)
        self._reduce(stats, self._tp_mask)
        for n, pc in enumerate(self.pieces):
            if n in self.variance:
                continue
            R, C = pc.param.shape
            at = self._stat_at[(pc.shard, pc.slot)]
            c_global = self._global(pc, C) if pc.tp_dim == 1 else C
            self.row_var[n].copy_(stats[at : at + R] / c_global)
            self.col_var[n].copy_(stats[at + R : at + R + C] / self._rows(pc, R))
            self._means[n] = (  # = global mean(r) over the real rows
                self.col_var[n].mean() if pc.tp_dim == 0 else self._mean_r(n, pc)
            )
        self._ckpt.clear()

    # ------------------------------------------------------------------ collectives
    def _reduce(self, buf: torch.Tensor, tp_ranges: list[tuple[int, int]]) -> None:
        """Sum partial statistics over the sharding group, then the ``tp_ranges`` entries over tp."""
        comm.all_reduce_via(buf, self.shard_group, self._comm_device)
        if comm.group_size(self.tp_group) > 1 and tp_ranges:
            idx = torch.cat([torch.arange(a, b) for a, b in tp_ranges]).to(buf.device)
            part = buf.index_select(0, idx)
            comm.all_reduce_via(part, self.tp_group, self._comm_device)
            buf.index_copy_(0, idx, part)

    def _global(self, pc: Piece, n: int) -> int:
        """The parameter's extent along a tp-split dim ``n`` elements long (n·tp when split)."""
        return n * comm.group_size(self.tp_group) if pc.tp_dim is not None else n

    def _rows(self, pc: Piece, R: int) -> int:
        """The global rows a matrix's statistics count: a padded vocabulary's V real ones, else all."""
        real = self._real_rows[(pc.shard, pc.slot)]
        return real if real is not None else self._global(pc, R) if pc.tp_dim == 0 else R

    def _mean_r(self, n: int, pc: Piece) -> torch.Tensor:
        """mean(r) over the real rows of a matrix whose rows this rank holds whole (not split over tp)."""
        real = self._real_rows[(pc.shard, pc.slot)]
        return self.row_var[n].mean() if real is None else self.row_var[n].sum() / real

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        """One Adafactor update of this rank's pieces from the reduced gradient shards."""
        # collectives run on the strategy's device when its gradient shards live in host memory
        # (ZeRO-3 offload_params: NCCL takes no host buffer), else where the gradients are
        self._comm_device = self.comm_device or (grads[0].device if grads else self.store.device)
        g32 = self.master.grads32(grads, grad_scale)
        self._ckpt.clear()
        self.step_count += 1
        t = float(self.step_count)
        beta = t**BETA2_DECAY
        rho = min(lr, 1.0 / t**0.5)
        dev = self.store.device
        stats = torch.zeros(self._stat_len, dtype=torch.float64, device=dev)
        views: list[tuple[int, Piece, torch.Tensor, torch.Tensor, tuple[int, int] | None]] = []
        # (piece index, piece, grad run, master run, its rows (r0, r1) of a matrix or None)
        for n, pc in enumerate(self.pieces):
            g = g32[pc.shard][pc.a : pc.b]
            w = self.masters[pc.shard][pc.a : pc.b]
            at = self._stat_at[(pc.shard, pc.slot)]
            if _factored(pc.param):
                R, C = pc.param.shape
                r0, r1 = pc.lo // C, (pc.hi - 1) // C + 1
                if pc.lo == r0 * C and pc.hi == r1 * C:  # whole rows: the gradient itself
                    pad = g.view(r1 - r0, C)
                else:  # partial first or last row: zeros around it (dropped after its sums)
                    pad = torch.zeros((r1 - r0) * C, dtype=torch.float32, device=dev)
                    pad[pc.lo - r0 * C : pc.hi - r0 * C] = g
                    pad = pad.view(r1 - r0, C)
                stats[at + r0 : at + r1] = torch.linalg.vector_norm(pad, dim=1).double().square()
                stats[at + R : at + R + C] = torch.linalg.vector_norm(pad, dim=0).double().square()
                stats[at + R + C] = w.norm(2).double().square()
                views.append((n, pc, g, w, (r0, r1)))
            else:
                stats[at] = w.norm(2).double().square()
                views.append((n, pc, g, w, None))
        self._reduce(stats, self._tp_mask)
        self._update(views, stats, lr, rho, beta)
        self.master.publish()

    def _row_means(self, views) -> dict[int, torch.Tensor]:
        """Σ r over the global rows of matrices whose rows tp splits (summed over tp), by piece (fp64,
        on the device: no host sync)."""
        split = [n for n, pc, *_ in views if pc.tp_dim == 0 and n in self.row_var]
        if not split or comm.group_size(self.tp_group) == 1:
            return {}
        sums = torch.stack([self.row_var[n].sum(dtype=torch.float64) for n in split])
        comm.all_reduce_via(sums, self.tp_group, self._comm_device)
        return dict(zip(split, sums, strict=True))

    def _update(self, views, stats: torch.Tensor, lr: float, rho: float, beta: float) -> None:
        """The statistics' update, then each piece's U twice: once for Σ U² (RMS(U), summed across
        ranks), once to apply it; one piece's V̂ at a time is the step's temporary (4·R·C bytes of its
        largest matrix), not every piece's U at once."""
        for n, pc, g, _w, rows in views:
            at = self._stat_at[(pc.shard, pc.slot)]
            if rows is not None:
                R, C = pc.param.shape
                row_mean = stats[at : at + R].float().div_(self._global(pc, C) if pc.tp_dim == 1 else C)
                col_mean = stats[at + R : at + R + C].float().div_(self._rows(pc, R))
                self.row_var[n].lerp_(row_mean, beta)
                self.col_var[n].lerp_(col_mean, beta)
            else:
                self.variance[n].lerp_(g * g, beta)
        split_means = self._row_means(views)
        usq = torch.zeros(len(self._param_index), dtype=torch.float64, device=stats.device)
        steps = []
        for n, pc, g, w, rows in views:
            at = self._stat_at[(pc.shard, pc.slot)]
            if rows is not None:
                R, C = pc.param.shape
                numel = self._rows(pc, R) * (self._global(pc, C) if pc.tp_dim == 1 else C)  # counted elements
                if n in split_means:
                    mean = (split_means[n] / self._rows(pc, R)).float()
                else:
                    mean = self._mean_r(n, pc)
                self._means[n] = mean
                psq = stats[at + R + C]
            else:
                numel = self._global(pc, pc.param.numel())
                psq = stats[at]
            alpha = (psq.sqrt() / numel**0.5).clamp_(min=EPS2).mul_(rho)  # fp64, on the device
            if self.weight_decay != 0 and pc.decay:
                w.mul_(1 - lr * self.weight_decay)
            k = self._param_index[(pc.shard, pc.slot)]
            usq[k] = self._direction(n, pc, g, rows).norm(2).double().square()
            steps.append((n, pc, g, w, rows, alpha, numel, k))
        tp_idx = [(k, k + 1) for k, dim in enumerate(self._tp_dims) if dim is not None]
        self._reduce(usq, tp_idx)
        for n, pc, g, w, rows, alpha, numel, k in steps:  # the step sizes stay on the device (no host sync)
            denom = (usq[k].sqrt() / (numel**0.5 * CLIP_D)).clamp_(min=1.0)
            u = self._direction(n, pc, g, rows)  # the same U again, bit for bit
            w.addcmul_(u, (-alpha / denom).float())  # bitwise w.add_(u, alpha=-alpha / denom) on the CPU

    def _direction(self, n: int, pc: Piece, g: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
        """U = G / sqrt(max(V̂, ε₁²)) on the piece: V̂ = r cᵀ / max(mean(r), ε₁) over its rows (a matrix),
        else the vector's v."""
        if rows is not None:
            C = pc.param.shape[1]
            r0, r1 = rows
            var = (self.row_var[n][r0:r1, None] @ self.col_var[n][None, :]).div_(
                self._means[n].clamp(min=self.eps1)
            )
            var = var.view(-1)[pc.lo - r0 * C : pc.hi - r0 * C]
        else:
            var = self.variance[n].clone()
        return var.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(g)


def factored_state_bytes(layouts: Sequence) -> int:
    """The module docstring's state bytes on this rank, from the layouts' geometry alone:
    Σ over the matrices this rank's shards touch of 4(R + C), plus 4 per vector element it holds."""
    pieces, _ = pieces_of(layouts)
    return sum(
        4 * (pc.param.shape[0] + pc.param.shape[1]) if pc.param.dim() == 2 else 4 * (pc.hi - pc.lo)
        for pc in pieces
    )
