"""ZeRO++: ZeRO-3 with quantized weight gathers (qwZ), a hierarchical secondary weight partition
(hpZ) and quantized gradient reduce-scatters (qgZ), each an option (``parallel.zeropp_*``).

- qwZ: a unit's all-gather sends this rank's shard as block-wise int8 codes with fp32 absmax scales
  (:mod:`.quantized`, blocks of B = 256 per shard) and dequantizes every rank's part into the full
  buffer, so every rank computes with the same (quantized) weights; the optimizer still updates the
  exact fp32 (or master) shards. Saving and ``full_state_dict`` gather exactly. A LoRA base (frozen
  weights) is quantized too; QLoRA's NF4 buffers (codes and the scales beside them, compressed
  already) travel exactly.
- hpZ: when a unit's *forward* gather completes, each rank keeps the 1/G slice of the full unit
  that is its part in its group of G ranks (``parallel.hpz_group``: one node), a secondary
  partition; the unit's *backward* gathers (and recomputations) all-gather that slice inside the
  group, never across nodes. The secondary copies are dropped when the step's reductions are done.
- qgZ: gradients reduce-scattered as int8 through an all-to-all
  (:class:`~loom.parallel.zero.quantized.QuantizedReducer`; dense units, expert units keep fp).

Bytes moved per rank per step, k micro-batches, N ranks sharding, units of Φ_u' elements of b bytes,
Φ_re' the units resharded after forward, q(x) = N·ceil(x/(N·B))·(B + 4) (x elements, quantized):

    forward all-gathers     k·Σ_u Φ_u'·b·(N-1)/N          qwZ: k·Σ_u q(Φ_u')·(N-1)/N
    backward all-gathers    k·Σ_re Φ_u'·b·(N-1)/N         hpZ: k·Φ_re'·b·(G-1)/G  (``all_gather_hpz``,
                                                           inside a node)   qwZ alone: k·Σ_re q(Φ_u')·(N-1)/N
    gradients               Φ'·b·(N-1)/N reduce-scatter   qgZ: Σ_u q(Φ_u')·(N-1)/N all-to-all
                                                           (int4: B/2 + 4 bytes per block in q)
    qgZ under tp            2·g·Φ_w'·(t-1)/t all-reduce over tp (``all_reduce_tp``): Φ_w' this rank's
                            shard elements of the parameters every tp rank keeps whole (norm weights),
                            g the gradient shard's bytes per element (4: fp32); the planner omits it

In fp32 qwZ and qgZ move (B + 4)/(4B) = 25.4% of the bytes they replace (bf16: 50.8%); with hpZ
nothing of the backward crosses a node. Memory: hpZ holds b·Φ_u'/G per resharded unit between its
forward and the end of the step (at most b·Φ_re'/G); the quantized buffers are transient.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from loom import comm
from loom.comm import CommMeter, Group
from loom.mesh import split_groups
from loom.parallel.placement import placement_of
from loom.parallel.reducer import GradReducer
from loom.parallel.zero.quantized import BLOCK, QuantizedReducer, Then, blocks, dequantize, quantize
from loom.parallel.zero.stage3 import GATHERING, FullyShardedZero, Unit, _in_backward


class TaggedMeter(CommMeter):
    """Records into ``inner`` under ``<op>_<tag>`` (hpZ's gathers, qgZ's first hop: intra-node traffic apart)."""

    def __init__(self, inner: CommMeter, tag: str) -> None:
        super().__init__()
        self.inner, self.tag = inner, tag

    def record(self, op: str, tensor_bytes: int, n: int) -> None:
        self.record_sent(op, tensor_bytes, comm.ring_bytes(op, tensor_bytes, n))

    def record_sent(self, op: str, tensor_bytes: int, sent_bytes: float) -> None:  # ring volumes: fractional
        key = f"{op}_{self.tag}"
        self.inner.calls[key] += 1
        self.inner.payload[key] += tensor_bytes
        self.inner.moved[key] += sent_bytes


def _sharding_groups(shard_group: Group) -> list[list[int]]:
    """Every rank's sharding group (its ranks, in order). A collective over the default group."""
    mine = (
        dist.get_process_group_ranks(shard_group)
        if shard_group is not None
        else list(range(dist.get_world_size()))
    )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def node_groups(shard_group: Group, size: int) -> Group:
    """This rank's group of ``size`` consecutive ranks of its sharding group. A collective over the
    default group: every rank learns every sharding group and creates every subgroup (one colouring)."""
    if comm.group_size(shard_group) <= size:
        return shard_group
    every = _sharding_groups(shard_group)
    lists = sorted({tuple(r[i : i + size]) for r in every for i in range(0, len(r), size)})
    return split_groups(lists, dist.get_rank())  # disjoint: one colouring, one split where NCCL splits


def stride_groups(shard_group: Group, size: int) -> Group:
    """This rank's group of the ranks at its place in every run of ``size`` consecutive ranks of its
    sharding group (one per node: qgZ's second hop). A collective over the default group."""
    every = _sharding_groups(shard_group)
    lists = sorted({tuple(r[i::size]) for r in every for i in range(size)})
    return split_groups(lists, dist.get_rank())


class ZeroPlusPlus(FullyShardedZero):
    """ZeRO-3 with the ZeRO++ options: ``qwz``, ``hpz_group`` (G ranks; 0 = no hpZ), ``qgz`` (in
    ``qgz_bits`` = 8 or 4 bits)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        qwz: bool = False,
        hpz_group: int = 0,
        qgz: bool = False,
        qgz_bits: int = 8,
        qgz_node: int = 0,
        **kwargs: Any,
    ) -> None:
        self.qwz, self.qgz, self.qgz_bits = qwz, qgz, qgz_bits
        self._exact = False  # gather the exact shards (saving, full_state_dict)
        self._secondary: dict[int, list[torch.Tensor]] = {}  # unit index -> its hpZ slices
        self._extra_bytes = 0  # secondary slices and quantized buffers alive
        shard_group = kwargs["shard_group"]
        self.hpz: Group | None = None
        self.hpz_size = 0
        if hpz_group:
            self.hpz = node_groups(shard_group, hpz_group)
            self.hpz_size = min(hpz_group, comm.group_size(shard_group))
        self._qgz_hops: tuple[Group, Group] = (None, None)  # qgZ's node and cross-node groups (hierarchical)
        if qgz and 0 < qgz_node < comm.group_size(shard_group):
            intra = self.hpz if self.hpz_size == qgz_node else node_groups(shard_group, qgz_node)
            self._qgz_hops = (intra, stride_groups(shard_group, qgz_node))
        meter = kwargs.get("meter")
        self._hpz_meter = TaggedMeter(meter, "hpz") if meter is not None else None
        super().__init__(module, **kwargs)

    def _reducer_for(self, p: torch.Tensor) -> GradReducer:
        if self.qgz and not isinstance(self.reducer, QuantizedReducer):
            self.reducer = QuantizedReducer.like(self.reducer, self.qgz_bits, *self._qgz_hops)
            self.reducer.node_meter = self._hpz_meter  # the first hop's bytes stay inside the node: apart
        return super()._reducer_for(p)

    # ------------------------------------------------------------------ gathers
    def _gather(self, u: Unit, how: str) -> None:
        if self._exact:
            super()._gather(u, how)
            return
        backward = _in_backward()
        hpz = self.hpz_size > 0 and u.group is self.shard_group
        secondary = self._secondary.get(u.index) if hpz and backward else None
        works: list = []
        finish: list = []
        keep: list = []
        nf4 = any(
            not f.full.is_floating_point() for f in u.frozen
        )  # QLoRA: codes + scales, compressed already
        for i, (full, shard) in enumerate(u.buffers()):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            exact = (
                not full.is_floating_point() or (nf4 and full is not u.full) or comm.group_size(u.group) == 1
            )
            if secondary is not None:
                works.append(comm.all_gather(full, secondary[i], self.hpz, self._hpz_meter, async_op=True))
            elif self.qwz and not exact:
                works += self._quantized_gather(full, shard, self._gather_group(u), finish, keep)
            else:
                works.append(comm.all_gather(full, shard, self._gather_group(u), self.meter, async_op=True))
        if hpz and not backward and u.reshard_after_forward:  # a unit kept gathered needs no backward gather
            finish.append(lambda: self._keep_secondary(u))
        nbytes = sum(comm.nbytes(t) for t in keep)
        self._extra_bytes += nbytes
        finish.append(lambda: self._free(nbytes))
        u.work = [Then(works, finish, tuple(keep))]
        u.state = GATHERING
        self.events.append(("gather", u.index, how))
        if secondary is not None:
            self.events.append(("secondary", u.index, how))
        self._track()

    def _quantized_gather(
        self, full: torch.Tensor, shard: torch.Tensor, group: Group, finish: list, keep: list
    ) -> list:
        """Start the all-gathers of ``shard``'s int8 codes and scales; ``finish`` dequantizes into ``full``."""
        n, per = comm.group_size(group), shard.numel()
        src = torch.zeros(blocks(per) * BLOCK, dtype=torch.float32, device=shard.device)
        src[:per] = shard
        q, scale = quantize(src)
        q_all = torch.empty(n * q.numel(), dtype=torch.int8, device=shard.device)
        s_all = torch.empty(n * scale.numel(), dtype=torch.float32, device=shard.device)
        keep += [q, scale, q_all, s_all]

        def dequant() -> None:
            full.view(n, per).copy_(dequantize(q_all, s_all).view(n, -1)[:, :per])

        finish.append(dequant)
        return [
            comm.all_gather(q_all, q, group, self.meter, async_op=True),
            comm.all_gather(s_all, scale, group, self.meter, async_op=True),
        ]

    def _keep_secondary(self, u: Unit) -> None:
        """After a forward gather: keep this rank's 1/G of each full buffer for the backward's gather."""
        g = dist.get_rank(self.hpz) if comm.group_size(self.hpz) > 1 else 0
        old = self._secondary.pop(u.index, [])
        self._extra_bytes -= sum(comm.nbytes(t) for t in old)
        part = []
        for full, _ in u.buffers():
            size = full.numel() // self.hpz_size
            part.append(full[g * size : (g + 1) * size].clone())
        self._secondary[u.index] = part
        self._extra_bytes += sum(comm.nbytes(t) for t in part)

    def _free(self, nbytes: int) -> None:
        self._extra_bytes -= nbytes

    def _drop_secondary(self) -> None:
        self._extra_bytes -= sum(comm.nbytes(t) for part in self._secondary.values() for t in part)
        self._secondary.clear()

    def _transient_bytes(self) -> int:
        return super()._transient_bytes() + self._extra_bytes

    # ------------------------------------------------------------------ Strategy
    def _reduce_all(self) -> None:
        super()._reduce_all()
        self._drop_secondary()  # the step's backwards are over
        if self.qgz:
            self._agree_over_tp()

    def _agree_over_tp(self) -> None:
        """qgZ's blocks mix a parameter every tp rank keeps whole (a norm weight, its gradient the same
        on every tp rank) with tp-split ones, so its reduced gradient carries per-rank quantization
        error and its replicas would drift apart: it is averaged over tp (one all-reduce of those
        few elements; gradients tp sums anyway, sp's partial ones, are left to that sum)."""
        tp = comm.group_size(self.tp_group)
        if tp == 1:
            return
        pieces = [
            g
            for p in self.params
            if (pl := placement_of(p)).tp_dim is None and pl.partial is None and pl.expert is None
            if (g := self.param_grad_shard(p)).numel()
        ]
        if not pieces:
            return
        flat = torch.cat([g.reshape(-1) for g in pieces])
        meter = TaggedMeter(self.meter, "tp") if self.meter is not None else None
        comm.all_reduce_via(flat, self.tp_group, self.comm_device or flat.device, meter)
        flat.div_(tp)
        offset = 0
        for g in pieces:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self._drop_secondary()
        super().step(lr, grad_scale)

    @contextlib.contextmanager
    def gathered(self):
        """All units gathered exactly (not quantized): to read or save the parameters."""
        self._exact = True
        try:
            with super().gathered() as module:
                yield module
        finally:
            self._exact = False
