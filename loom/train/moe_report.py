"""Mixture-of-experts observability: per-layer expert load in the metrics rows, a heatmap at the end.

Each MoE layer counts, over the forwards of training (not recomputations), the assignments
routed to each expert before dropping, the dropped assignments and its aux and z losses
(:class:`loom.model.moe.MoEFeedForward`). A metrics row sums those counts over every rank of the
world (one all-reduce of L·(E + 4) numbers: a rank holds only its pipeline stages' layers;
replicas of a layer add the same share to every count, so the ratios below are the single
process's) and reports, for layer l since the previous row:

    moe/l{l}/load       assignments per expert / all assignments (a list; jsonl only)
    moe/l{l}/imbalance  max_e load_e / mean_e load_e (1 = balanced, E = all on one expert)
    moe/l{l}/dropped    dropped assignments / all assignments (capacity; 0 when dropless)
    moe/l{l}/aux, z     mean over micro-batches of the aux and z losses (without coefficients)

and ``moe_imbalance``, the largest layer imbalance. :meth:`MoEReport.heatmap` draws the loads of
the whole run as an L × E picture (relative load E·share; 1 = even).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.model.moe import N_STATS, moe_layers


class MoEReport:
    """Collects the MoE layers' statistics of ``model`` (a whole model or a rank's stages)."""

    def __init__(self, model: nn.Module, n_layers: int, n_experts: int, device: torch.device) -> None:
        self.model, self.n_layers, self.n_experts, self.device = model, n_layers, n_experts, device
        self.run_load = torch.zeros(n_layers, n_experts, dtype=torch.float64)
        for m in moe_layers(model):  # forwards before training (a pipeline's profiling) do not count
            m.stats = None

    def row(self) -> dict[str, Any]:
        """The metrics fields since the last call; a collective over the world (every rank calls it)."""
        E = self.n_experts
        table = torch.zeros(self.n_layers, E + N_STATS, device=self.device)
        for m in moe_layers(self.model):
            if m.stats is not None:
                table[m.layer_id] += m.stats.to(table.device)
                m.stats = None
        comm.all_reduce(table, dist.group.WORLD if dist.is_initialized() else None)
        table = table.double().cpu()
        out: dict[str, Any] = {}
        worst = 0.0
        for layer in range(self.n_layers):
            load, (dropped, aux, z, forwards) = table[layer, :E], table[layer, E:].tolist()
            total = float(load.sum())
            if forwards == 0 or total == 0:
                continue
            self.run_load[layer] += load / total * forwards  # weighted by forwards: the run's mean share
            imbalance = float(load.max() / load.mean())
            worst = max(worst, imbalance)
            out |= {
                f"moe/l{layer}/load": (load / total).tolist(),
                f"moe/l{layer}/imbalance": imbalance,
                f"moe/l{layer}/dropped": dropped / total,
                f"moe/l{layer}/aux": aux / forwards,
                f"moe/l{layer}/z": z / forwards,
            }
        if out:
            out["moe_imbalance"] = worst
        return out

    def heatmap(self, path: Path) -> Path | None:
        """Write the run's relative load per (layer, expert) as a PNG; None before any row."""
        share = self.run_load / self.run_load.sum(1, keepdim=True).clamp_min(1e-12)
        if float(self.run_load.sum()) == 0:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rel = (share * self.n_experts).numpy()
        fig = Figure(figsize=(1.2 + 0.45 * self.n_experts, 1.0 + 0.4 * self.n_layers))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        im = ax.imshow(rel, cmap="viridis", aspect="auto", vmin=0)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_xticks(range(self.n_experts))
        ax.set_yticks(range(self.n_layers))
        ax.set_title("expert load over the run (1 = even)")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path
