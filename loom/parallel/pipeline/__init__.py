"""Pipeline parallelism: layer partitioning, schedules as data, their simulation."""

from loom.parallel.pipeline.partition import parse_layout, partition, stage_sums
from loom.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    build_schedule,
    stashed_versions,
    weight_versions,
)
from loom.parallel.pipeline.simulate import Event, ScheduleError, Timeline, check, peak_in_flight, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "build_schedule",
    "check",
    "parse_layout",
    "partition",
    "peak_in_flight",
    "simulate",
    "stage_sums",
    "stashed_versions",
    "weight_versions",
]
