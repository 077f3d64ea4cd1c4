"""Routing over many engines: a block-hash index of their caches and the policies that use it.

Pure (no I/O, no clock): the router (:mod:`pagedkv.router`) and the simulator run this code.
"""

from pagedkv.route.index import PrefixIndex
from pagedkv.route.policy import (
    POLICY_NAMES,
    CacheAware,
    CacheAwareConfig,
    Decision,
    EngineLoad,
    LeastLoad,
    RoundRobin,
    RoutingPolicy,
    make_policy,
)

__all__ = [
    "POLICY_NAMES",
    "CacheAware",
    "CacheAwareConfig",
    "Decision",
    "EngineLoad",
    "LeastLoad",
    "PrefixIndex",
    "RoundRobin",
    "RoutingPolicy",
    "make_policy",
]
