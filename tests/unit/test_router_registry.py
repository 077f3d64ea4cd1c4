"""The router's engine registry changes membership without I/O: add, remove, release and
take-out on an engine that was removed meanwhile (no KeyError, no stale index entry)."""

from __future__ import annotations

import pytest

from pagedkv.router.app import parse_engine_url
from pagedkv.router.engines import EngineRegistry

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def test_add_and_remove_are_idempotent_and_drop_the_index() -> None:
    reg = EngineRegistry([A], poll_interval_s=0.3)
    assert reg.discovery_interval_s == 0.3  # the default: re-probe at the poll interval
    assert reg.add(B + "/")
    assert not reg.add(B)  # listed already (the trailing slash is the same URL)
    assert list(reg.engines) == [A, B]
    with reg.lock:
        reg.engines[B].healthy = True
        reg.engines[B].in_flight = 1
        reg.index.store(B, [b"h1", b"h2"], "GPU")
        assert [e.engine for e in reg.routable()] == [B]
    generation = reg.engines[B].generation
    handle = reg.engines[B]
    assert reg.remove(B)
    assert not reg.remove(B)
    assert handle.generation == generation + 1  # its event thread stops
    assert not handle.healthy
    assert reg.index.num_blocks(B) == 0
    assert reg.index.match([b"h1"]) == {}
    with reg.lock:
        assert reg.routable() == []
    reg.release(B)  # a request that finishes after its engine was removed
    reg.mark_failed(B, "late failure")  # no KeyError
    assert reg.add(B)
    reg.release(B)  # the re-added engine's fresh handle never goes below 0
    assert reg.engines[B].in_flight == 0


def test_engine_url_is_a_base_http_url() -> None:
    assert parse_engine_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert parse_engine_url("https://engine.local:443") == "https://engine.local:443"


@pytest.mark.parametrize("bad", ["ftp://x:1", "http://h:1/v1", "127.0.0.1:8000", 8000, None])
def test_engine_url_refuses_anything_else(bad: object) -> None:
    with pytest.raises(ValueError, match=r"url must be a string|base URL"):
        parse_engine_url(bad)
