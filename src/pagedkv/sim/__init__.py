"""Workload simulation: replay requests through the real scheduler with a step-cost model."""

from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.generators import WORKLOADS, make_workload
from pagedkv.sim.report import Percentiles, RequestRecord, SimReport, TimeSeries, WallTimings
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.trace import load_trace, parse_trace, save_trace
from pagedkv.sim.variants import build_variants
from pagedkv.sim.workload import SimRequest, Workload, token_run

__all__ = [
    "WORKLOADS",
    "CostModel",
    "Percentiles",
    "RequestRecord",
    "SimConfig",
    "SimReport",
    "SimRequest",
    "TimeSeries",
    "WallTimings",
    "Workload",
    "build_variants",
    "load_trace",
    "make_workload",
    "parse_trace",
    "save_trace",
    "simulate",
    "token_run",
]
