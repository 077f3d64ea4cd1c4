"""The KV-aware router: an OpenAI-compatible proxy over many engines, fed by their KV events.

``pagedkv router --engine URL ...`` (:mod:`pagedkv.router.cli`); the policies live in the pure
:mod:`pagedkv.route`.
"""

from pagedkv.router.app import build_router_app
from pagedkv.router.engines import EngineHandle, EngineRegistry, HashSpec
from pagedkv.router.proxy import Router

__all__ = ["EngineHandle", "EngineRegistry", "HashSpec", "Router", "build_router_app"]
