"""Workload simulation: replay requests through the real scheduler with a step-cost model."""

from pagedkv.sim.cost_model import CostModel, StepCost, step_totals
from pagedkv.sim.generators import WORKLOADS, make_workload
from pagedkv.sim.hardware import DEVICE_PRESETS, MODEL_PRESETS, DeviceSpec, ModelSpec, model_spec
from pagedkv.sim.profile import ProfileFit, fit_profile, load_profile
from pagedkv.sim.report import Percentiles, RequestRecord, SimReport, TimeSeries, WallTimings
from pagedkv.sim.roofline import PoolSizing, RooflineCost, size_pool
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.trace import load_trace, parse_trace, save_trace
from pagedkv.sim.variants import build_variants
from pagedkv.sim.workload import SimRequest, Workload, token_run

__all__ = [
    "DEVICE_PRESETS",
    "MODEL_PRESETS",
    "WORKLOADS",
    "CostModel",
    "DeviceSpec",
    "ModelSpec",
    "Percentiles",
    "PoolSizing",
    "ProfileFit",
    "RequestRecord",
    "RooflineCost",
    "SimConfig",
    "SimReport",
    "SimRequest",
    "StepCost",
    "TimeSeries",
    "WallTimings",
    "Workload",
    "build_variants",
    "fit_profile",
    "load_profile",
    "load_trace",
    "make_workload",
    "model_spec",
    "parse_trace",
    "save_trace",
    "simulate",
    "size_pool",
    "step_totals",
    "token_run",
]
