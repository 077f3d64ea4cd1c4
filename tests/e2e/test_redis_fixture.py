"""The Redis fixtures' own contract (``conftest.RedisServer``): a port taken between choosing
it and the server binding it (another process, a cluster node's outgoing connection) moves a
first start to a fresh port instead of failing the test; a restart keeps its port."""

from __future__ import annotations

import socket
from typing import Any

import pytest

pytestmark = pytest.mark.redis


def test_a_first_start_on_a_taken_port_moves_and_a_restart_keeps_it(
    unstarted_redis_server: Any,
) -> None:
    server = unstarted_redis_server
    taken = server.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen(1)
        server.start()
        assert server.port != taken
        moved = server.port
        server.stop()
    server.start()  # a restart: the same port, which tests rely on
    assert server.port == moved
