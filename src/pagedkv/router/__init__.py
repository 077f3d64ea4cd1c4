"""The KV-aware router: an OpenAI-compatible proxy over many engines, fed by their KV events.

``pagedkv router --engine URL ...`` (:mod:`pagedkv.router.cli`); the policies live in the pure
:mod:`pagedkv.route`.
"""

from pagedkv.router.app import build_router_app
from pagedkv.router.engines import EngineHandle, EngineRegistry, HashSpec

__all__ = ["EngineHandle", "EngineRegistry", "HashSpec", "build_router_app"]
