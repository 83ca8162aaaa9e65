"""The throughputs the cost model uses: a cluster's datasheet numbers, or a profile's measurements."""

from __future__ import annotations

import math

from loom.plan.hardware import datasheets
from loom.plan.hardware.clusters import ClusterSpec
from loom.plan.hardware.datasheets import HardwareError
from loom.plan.hardware.profiles import CollectiveFit, Profile

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


class Machine:
    """Throughputs the cost model uses, from a cluster's specs or, where measured, a :class:`Profile`.

    Compute: ``flops = gemm_flops[precision]`` from the profile, else ``peak * achievable``.
    Collectives on ``n`` devices of a message of ``S`` bytes (the full, unsharded buffer), with
    ``B`` the link bandwidth times ``comm_efficiency`` and ``l`` the per-hop latency (ring
    algorithms, as in the NCCL bus-bandwidth convention)::

        all_reduce      2 (n-1)/n * S / B + 2 (n-1) l
        all_gather      (n-1)/n * S / B + (n-1) l       (S = gathered size)
        reduce_scatter  (n-1)/n * S / B + (n-1) l       (S = input size)
        all_to_all      (n-1)/n * S / B + (n-1) l       (S = bytes one device holds)
        p2p             S / B + l

    A group whose ranks span more than one node (``span > devices_per_node``) uses the
    inter-node link (:meth:`inter_bandwidth`); an all-to-all there is no ring: each rank sends S/n
    to every other rank, the k - 1 in its node over the intra-node link and the n - k beyond it
    through its own NIC share, both at once::

        all_to_all      max((n-k)/n * S / B_nic, (k-1)/n * S / B_intra) + (n-1) l_inter

    A measured fit replaces ``B`` by its bus bandwidth and the latency term by its latency.
    """

    def __init__(self, cluster: ClusterSpec, precision: str, profile: Profile | None = None) -> None:
        self.cluster = cluster
        self.precision = precision
        self.profile = profile
        dev = cluster.device
        self.peak = dev.peak_flops(precision)
        measured = profile.gemm_flops.get(precision, 0.0) if profile else 0.0
        self.flops = measured if measured > 0 else self.peak * dev.gemm_share(precision)
        # attention kernels run in bf16 under fp8/int8 Linears (Transformer Engine, torchao)
        self.attention_peak = dev.peak_flops("bf16") if precision in ("fp8", "int8") else self.peak
        # the rate of a GEMM an fp8/int8 run keeps in bf16 (a Linear not swapped): measured or datasheet
        measured_bf16 = profile.gemm_flops.get("bf16", 0.0) if profile else 0.0
        self.bf16_flops = (
            (measured_bf16 if measured_bf16 > 0 else self.attention_peak * dev.gemm_share("bf16"))
            if precision in ("fp8", "int8")
            else self.flops
        )
        self.measured_gemm = measured > 0
        self.hbm = profile.hbm_bandwidth if profile and profile.hbm_bandwidth > 0 else dev.hbm_bandwidth
        self.call_overhead = (
            dict(profile.call_overhead) if profile else {}
        )  # kind (tp, ep) -> s added to each call
        measured_op = profile.op_overhead.get(precision, 0.0) if profile else 0.0
        self.op_time = measured_op if measured_op > 0 else dev.op_overhead  # s per ATen operator
        self.microbatch_overhead = (
            profile.microbatch_overhead
            if profile and profile.microbatch_overhead
            else dev.microbatch_overhead
        )
        self.optimizer_rates = dict(dev.optimizer_rates) | (profile.optimizer_rate if profile else {})
        self._overlap = profile.comm_overlap if profile else {}

        eff = cluster.comm_efficiency
        self._links = {
            "intra": (cluster.intra_bandwidth * eff, cluster.intra_latency),
            "inter": (cluster.inter_bandwidth * eff, cluster.inter_latency),
        }

    def comm_overlap(self, world: int) -> float:
        """Share of a collective's time hidden when it runs beside compute: measured at the nearest job size, else the device's."""
        if not self._overlap:
            return self.cluster.device.comm_overlap
        return self._overlap[min(self._overlap, key=lambda w: (abs(int(w) - world), -int(w)))]

    def inter_bandwidth(self, n: int, span: int) -> float:
        """Bus bandwidth of a ring collective over ``n`` ranks spread evenly over the nodes that
        ``span`` consecutive ranks cover: NCCL runs one ring per NIC, each crossing every node
        boundary once, so the k = n / nodes members of a node share their k NICs and the bus
        bandwidth is k times one device's NIC share (nccl-tests: ~8 x 25 GB/s on 8 x HDR DGX A100
        nodes), never above the intra-node link (times comm_efficiency, as every link here)."""
        per = self.cluster.devices_per_node
        nodes = max(1, -(-span // per))
        k = max(1.0, min(per, n / nodes))
        intra, _ = self._links["intra"]
        return min(intra, k * self._links["inter"][0])

    def alpha_beta(self, n: int, span: int) -> tuple[float, float]:
        """(α seconds per round, β seconds per byte) of one link of a group of ``n`` ranks covering
        ``span`` consecutive ranks: the latency and bandwidth :meth:`collective` uses without a profile."""
        scope = self.scope(span)
        bw, lat = self._links[scope]
        if scope == "inter":
            bw = self.inter_bandwidth(n, span)
        return lat, 1.0 / bw

    def scope(self, span: int) -> str:
        """``intra`` if a group whose ranks cover ``span`` consecutive ranks stays in one node."""
        return "intra" if span <= self.cluster.devices_per_node else "inter"

    def collective(
        self, op: str, n: int, size: float, span: int, world: int | None = None, synced: bool = False
    ) -> float:
        """Seconds for ``op`` over ``n`` devices on a message of ``size`` bytes (see class doc),
        in a job of ``world`` ranks (picks the profile's fit measured nearest that job size);
        ``synced``: a call between ranks already in step (the profile's back-to-back fit, if any)."""
        if n <= 1 or size <= 0:
            return 0.0
        scope = self.scope(span)
        bw, lat = self._links[scope]
        if scope == "inter":
            bw = self.inter_bandwidth(n, span)
        fit = self._fit(op, scope, n, world, synced)
        if op == "all_to_all" and scope == "inter" and fit is None:
            return self._all_to_all_across_nodes(n, size, span)
        if op == "all_reduce":
            volume, hops = 2.0 * (n - 1) / n * size, 2 * (n - 1)
        elif op in ("all_gather", "reduce_scatter", "all_to_all"):
            volume, hops = (n - 1) / n * size, n - 1
        elif op == "p2p":
            volume, hops = size, 1
        else:
            raise HardwareError(f"collective op: must be one of {COLLECTIVE_OPS}, got {op!r}")
        if fit is not None:
            return fit.latency + volume / fit.bus_bandwidth
        return hops * lat + volume / bw

    def _all_to_all_across_nodes(self, n: int, size: float, span: int) -> float:
        """An all-to-all of ``size`` bytes per rank over ``n`` ranks spread evenly over the nodes
        ``span`` consecutive ranks cover (k per node): (n - k)/n of each rank's bytes leave its node
        through its own NIC share, (k - 1)/n go over the intra-node link, concurrently."""
        per = self.cluster.devices_per_node
        k = max(1.0, min(per, n / max(1, -(-span // per))))
        (intra, _), (nic, lat) = self._links["intra"], self._links["inter"]
        return (n - 1) * lat + max((n - k) / n * size / nic, (k - 1) / n * size / intra)

    def _fit(self, op: str, scope: str, n: int, world: int | None, synced: bool) -> CollectiveFit | None:
        """The profile's fit; ``synced`` (ranks already in step) prefers a back-to-back measurement."""
        if self.profile is None:
            return None
        if synced and scope == "intra":
            fit = self.profile.collective(op, "synced", n, world)
            if fit is not None and fit.op == op:
                return fit
        return self.profile.collective(op, scope, n, world)

    def latency(self, op: str, n: int, span: int, world: int | None = None, synced: bool = False) -> float:
        """Fixed cost of one call of ``op`` over ``n`` devices (the size-independent part)."""
        if n <= 1:
            return 0.0
        scope = self.scope(span)
        fit = self._fit(op, scope, n, world, synced)
        if fit is not None:
            return fit.latency
        hops = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(op, n - 1)
        return hops * self._links[scope][1]

    def gemm(
        self, m: float, k: float, n: float, elem_bytes: float, batch: float = 1, bf16: bool = False
    ) -> float:
        """Time of an (m x k) @ (k x n) product: the larger of its compute and its HBM traffic
        ``elem_bytes (mk + kn + mn) / HBM`` (the roofline). ``bf16``: a product that an fp8 / int8 run
        keeps in bf16, at :attr:`bf16_flops` (the precision's own rate otherwise).

        Compute, on a device with ``sms`` > 0 and no measured GEMM rate: the output is cut into
        ``tiles = ceil(m / tm) ceil(n / tn)`` blocks of the device's tile (tm, tn) — shrunk to the
        power of two (>= 16) covering m or n when that is smaller, as a library picks a smaller
        tile for a skinny product; they run in
        ``waves = ceil(tiles / sms)`` rounds, each round one tile per SM at the sustained rate
        ``peak * achievable / sms``, over ``k + GEMM_K0`` steps (the main loop plus its prologue
        and epilogue)::

            t = waves * 2 tm tn (k + GEMM_K0) / (peak * achievable / sms)

        (``batch`` independent products share the waves), which is ``2mkn / (peak * achievable)`` times the tile quantization (padded edges), the
        wave quantization (a last, partly idle round) and ``(k + K0) / k``: thin tensor-parallel
        slices and small hidden sizes run below large square products. Otherwise (CPU, or a
        calibrated rate) ``2mkn / flops``.
        """
        memory = batch * elem_bytes * (m * k + k * n + m * n) / self.hbm
        flops = self.bf16_flops if bf16 else self.flops
        sms = self.cluster.device.sms
        if sms <= 0 or self.measured_gemm:
            return max(2.0 * batch * m * k * n / flops, memory)
        tm, tn = (
            min(t, max(16, 2 ** math.ceil(math.log2(max(d, 1)))))
            for t, d in zip(self.cluster.device.tile, (m, n))
        )
        tiles = math.ceil(batch - 1e-9) * math.ceil(m / tm - 1e-9) * math.ceil(n / tn - 1e-9)
        waves = math.ceil(tiles / sms - 1e-9)
        return max(waves * 2.0 * tm * tn * (k + datasheets.GEMM_K0) * sms / flops, memory)

    def attention(self, flops: float, backward: bool) -> float:
        """Seconds of a flash-attention kernel of ``flops`` at the device's flash efficiency (its
        ``flash_fwd`` / ``flash_bwd`` share of the bf16 peak under fp8/int8 GEMMs, else of the
        precision's; the GEMM rate when not given or measured)."""
        dev = self.cluster.device
        share = dev.flash_bwd if backward else dev.flash_fwd
        return flops / (self.attention_peak * share if share > 0 and not self.measured_gemm else self.flops)
