"""Optional peers run on pagedkv's fixtures in the same process (no peer code lives here).

Each peer module loads the peer's own files from a source tree the user extracted, supplies
tiny stand-ins for the imports a benchmark never exercises, and describes the fixtures it
supports as :class:`_harness.Case` objects, timed interleaved with pagedkv's.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from _harness import Case

PEERS = {"vllm": "peers.vllm_peer", "infinilm": "peers.infinilm_peer"}


class Peer(Protocol):
    def cases(self, fixture: str, quick: bool) -> list[Case]:
        """The peer's cases for one of bench_core's fixtures (empty if it has none)."""


def load_peer(name: str, path: str) -> Peer:
    """Load peer ``name`` from its source tree at ``path``; ImportError/OSError if it cannot."""
    module = importlib.import_module(PEERS[name])
    peer: Peer = module.load(path)
    return peer
