"""Block-wise int8 quantization for ZeRO++'s collectives, and the quantized gradient reducer (qgZ).

A flat fp tensor is cut into blocks of B = 256 elements (the last padded with zeros); each block
is stored as int8 codes q = round(x / s) in [-127, 127] with one fp32 scale s = absmax / 127.
A block of B elements travels as B + 4 bytes instead of B·b (b = 4 in fp32: 3.94x fewer bytes;
b = 2 in bf16: 1.97x). The error of one element is at most s/2 = absmax/254 of its block. In int4
(qgZ's option, ``parallel.zeropp_qgz_bits = 4``) codes are in [-7, 7], two to a byte: B/2 + 4 bytes
per block, an error of at most absmax/14.

qgZ (:class:`QuantizedReducer`): instead of a reduce-scatter of the fp gradient, each rank
quantizes the N destination chunks of its gradient (Φ_u'/N elements each, blocked separately),
sends chunk j to rank j with one all-to-all (codes and scales), and sums the N dequantized chunks
it receives in fp32, in rank order. Bytes sent per rank for a unit of Φ_u' elements:

    all_to_all  N·ceil(Φ_u'/(N·B))·(B·bits/8 + 4)·(N-1)/N   (reduce-scatter: Φ_u'·b·(N-1)/N)

Hierarchical (ZeRO++'s, when the sharding group spans nodes of G ranks, N = M·G: ``intra`` and
``inter`` groups): rank (m, g) first sends its local peer g' the M chunks destined for ranks
(m', g') of every node, quantized (an all-to-all inside the node); each rank sums the G dequantized
contributions for its M chunks in fp32, quantizes those partial sums again and sends chunk m' to
rank (m', g) (an all-to-all across nodes, one rank per node), then sums the M it receives. Bytes
sent per rank, q = N·ceil(Φ_u'/(N·B))·(B·bits/8 + 4):

    inside a node   q·(G-1)/G          across nodes   (q/G)·(M-1)/M

so 1/G of the one-hop bytes cross nodes, at the cost of a second quantization of the partial sums.
The replicas' all-reduce of the shard (hybrid sharding) is unchanged, in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.reducer import GradReducer, _Pending

BLOCK = 256  # elements per quantization block
SCALE_BYTES = 4  # one fp32 absmax scale per block


def blocks(numel: int) -> int:
    """Blocks of BLOCK elements covering ``numel`` elements."""
    return -(-numel // BLOCK)


def quantized_bytes(numel: int, bits: int = 8) -> int:
    """Bytes of ``numel`` elements as ``bits``-bit codes and fp32 scales, padded to whole blocks."""
    return blocks(numel) * (BLOCK * bits // 8 + SCALE_BYTES)


def quantize(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, fp32 scales) of ``x`` (1-D, a multiple of BLOCK elements): int8 codes in [-127, 127]
    with s = absmax/127, or (``bits`` = 4) codes in [-7, 7] with s = absmax/7, two to a uint8."""
    levels = 127.0 if bits == 8 else 7.0
    v = x.float().view(-1, BLOCK)
    scale = v.abs().amax(dim=1) / levels
    q = torch.round(v / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-levels, levels)
    if bits == 8:
        return q.to(torch.int8).view(-1), scale
    pairs = (q + 8).to(torch.uint8).view(-1, 2)  # 1..15
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """fp32 values of ``bits``-bit codes ``q`` with one ``scale`` per block."""
    if bits == 4:
        q = torch.stack([q & 15, q >> 4], dim=1).view(-1).to(torch.int8) - 8
    return (q.view(-1, BLOCK).float() * scale[:, None]).view(-1)


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` cut into ``rows`` equal rows, each zero-padded to whole blocks, flattened (fp32)."""
    per = x.numel() // rows
    out = torch.zeros(rows, blocks(per) * BLOCK, dtype=torch.float32, device=x.device)
    out[:, :per] = x.view(rows, per)
    return out.view(-1)


class Then:
    """Collectives in flight, and what to do once they are done: waiting runs ``finish`` once."""

    def __init__(self, works: list, finish: list, keep: tuple = ()) -> None:
        self.works, self.finish = works, finish
        self.keep = keep  # buffers the collectives read or write, alive until they are done

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works, self.keep = [], ()
        finish, self.finish = self.finish, []
        for f in finish:
            f()
        return True


def all_to_all(out: torch.Tensor, x: torch.Tensor, group: Group, meter: CommMeter | None):
    """Asynchronous equal-split all-to-all of flat ``x`` into ``out``; metered as the (N-1)/N sent."""
    n = comm.group_size(group)
    comm.check_tensors("all_to_all", group, out, x)
    if meter is not None:
        meter.record_sent("all_to_all", comm.nbytes(x), comm.nbytes(x) * (n - 1) // n)  # whole blocks: exact
    return dist.all_to_all_single(out, x, group=group, async_op=True)


class QuantizedReducer(GradReducer):
    """:class:`GradReducer` whose reduce-scatter is int8 (or int4, ``bits``) codes through an all-to-all (qgZ)."""

    bits = 8
    intra: Group = None  # hierarchical: this rank's node (G consecutive ranks of the sharding group)
    inter: Group = None  # ... and the ranks of the other nodes at its place in theirs (M ranks)
    node_meter: CommMeter | None = None  # meters the first hop (inside the node), if given

    def _exchange(
        self, x: torch.Tensor, group: Group, inside: bool = False
    ) -> tuple[Then, torch.Tensor, torch.Tensor]:
        """Quantize flat ``x`` and start its equal-split all-to-all over ``group``: (the collectives, with
        the codes and scales sent kept alive until done; the codes and scales received)."""
        q, scale = quantize(x, self.bits)
        q_in, s_in = torch.empty_like(q), torch.empty_like(scale)
        meter = self.node_meter if inside and self.node_meter is not None else self.meter
        works = [all_to_all(q_in, q, group, meter), all_to_all(s_in, scale, group, meter)]
        return Then(works, [], (q, scale)), q_in, s_in

    def launch(self, full: torch.Tensor, dest: torch.Tensor, owned: bool = True) -> None:
        n = comm.group_size(self.shard_group)
        if n == 1:
            super().launch(full, dest, owned)
            return
        per = full.numel() // n
        send = padded(full, n).div_(self.dp)
        out = torch.empty(per, dtype=torch.float32, device=full.device)
        g = comm.group_size(self.intra) if self.intra is not None else n
        m, rows = n // g, send.numel() // n
        if g < n:  # hop 1 inside the node: to local peer g' the chunks of ranks (m', g'), every m'
            send = send.view(m, g, rows).transpose(0, 1).contiguous().view(-1)
        hop1, q_in, s_in = self._exchange(send, self.intra if g < n else self.shard_group, inside=g < n)

        def finish() -> None:  # Σ over the N senders of their dequantized chunk for this rank, fp32
            if g == n:
                out.copy_(dequantize(q_in, s_in, self.bits).view(n, -1)[:, :per].sum(dim=0))
                return
            node = dequantize(q_in, s_in, self.bits).view(g, -1).sum(dim=0)  # (m·rows): the node's sums
            hop2, q2, s2 = self._exchange(node, self.inter)  # hop 2 across nodes: chunk m' to (m', g)
            hop2.wait()
            out.copy_(dequantize(q2, s2, self.bits).view(m, rows)[:, :per].sum(dim=0))

        codes = comm.nbytes(q_in) + comm.nbytes(s_in)  # as many sent as received
        transient = comm.nbytes(send) + 2 * codes + comm.nbytes(out)
        for p in self.inflight:  # the earlier shards go on to their replicas now
            self._replicate(p, during_backward=True)
        hop1.finish.append(finish)
        self.inflight.append(_Pending(hop1, send, out, dest, transient))
        while len(self.inflight) > self.max_inflight:
            self._complete(self.inflight.popleft())

    @classmethod
    def like(
        cls, r: GradReducer, bits: int = 8, intra: Group = None, inter: Group = None
    ) -> QuantizedReducer:
        """A qgZ reducer over ``r``'s groups in ``bits`` bits; hierarchical with ``intra`` and ``inter``."""
        out = cls(
            r.shard_group, r.replicate_group, r.dp, r.meter, r.reduce_dtype, r.max_inflight, r.all_reduce
        )
        out.bits, out.intra, out.inter = bits, intra, inter
        return out
