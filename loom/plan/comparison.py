"""What ``loom plan validate`` reports per layout (:class:`Comparison`) and its tolerances; read by
:mod:`loom.plan.validate`, which runs the layouts, and :mod:`loom.plan.viz`, which draws them."""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_TOLERANCE = 0.05  # |predicted - measured| / measured rank-0 model-state bytes a layout passes within
TIME_TOLERANCE = 0.20  # the same of the step time (reported, not gated: a shared machine's noise)


@dataclass
class Comparison:
    """One layout: predicted vs measured step time (s) and rank-0 model-state bytes."""

    name: str
    ranks: int
    pred_step_s: float
    meas_step_s: float
    pred_state_bytes: float
    meas_state_bytes: float
    meas_median_s: float = 0.0  # the median step over all runs: how far a typical step is from the fastest

    @property
    def time_error(self) -> float:
        return (self.pred_step_s - self.meas_step_s) / self.meas_step_s

    @property
    def memory_error(self) -> float:
        return (self.pred_state_bytes - self.meas_state_bytes) / self.meas_state_bytes
