"""End-to-end fixtures: a real ``redis-server`` on a free loopback port in a temporary folder.

The server runs without persistence (``--save ""``, no AOF) so a stop loses every key, as an
evicting or restarted cache server would. Tests marked ``redis`` use it; ``.ci/run`` installs the
binary, and a missing binary fails those tests (deselect them with ``-m "not redis"``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A loopback port free now and not in ``avoid``. Free now only: another process (or a
    cluster node's outgoing connection) can take it before the server binds it, so a first
    start that finds it taken picks again (``RedisServer.start``)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


class RedisServer:
    """A ``redis-server`` child process that tests can stop and start again on the same port."""

    def __init__(self, folder: Path, extra_args: tuple[str, ...] = ()) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
        self.exe = exe
        self.folder = folder
        self.port = _free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False  # a restart keeps the port; a first start may move off a taken one

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start and wait for ``PING``. The first start retries on fresh ports (the client's,
        and a cluster bus port in ``extra_args``) when a port was taken between choosing and
        binding it; later starts keep the port, which tests rely on."""
        for _ in range(5):
            if self._start_once():
                break
            self.port = _free_port()
            self.extra_args = _fresh_bus_port(self.extra_args)
        else:
            pytest.fail(f"redis-server found its ports taken five times (last {self.port})")
        self._started = True

    def _start_once(self) -> bool:
        """One start: True once it answers; False when it exited because a port was taken;
        fails the test on any other exit or silence."""
        args = [
            self.exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.folder),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.folder / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        logfile = self.folder / "redis.log"
        seen = logfile.stat().st_size if logfile.exists() else 0  # this start's lines only
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                log = logfile.read_bytes()[seen:].decode(errors="replace")[-2000:]
                self.proc = None
                if "Address already in use" in log and not self._started:
                    return False
                pytest.fail(f"redis-server exited with {code}: {log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        pytest.fail(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


def _fresh_bus_port(args: tuple[str, ...]) -> tuple[str, ...]:
    """``args`` with a fresh port after ``--cluster-port``, if it has one, and the cluster
    config file the failed start may have written (with the old ports) removed."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--cluster-port":
            out[i + 1] = str(_free_port())
        elif arg == "--cluster-config-file":
            Path(out[i + 1]).unlink(missing_ok=True)
    return tuple(out)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test, stopped afterwards."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def unstarted_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with its port chosen, not started (the test starts it); stopped after."""
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def small_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with 4 MB of memory that evicts least recently used keys."""
    server = RedisServer(tmp_path, ("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RedisCluster:
    """Three ``redis-server --cluster-enabled yes`` masters on loopback, joined by
    ``redis-cli --cluster create`` (no replicas: stopping a master loses its slots).

    ``full_coverage=False`` starts the masters with ``cluster-require-full-coverage no``: the
    survivors of a lost master keep serving their own slots. Under Redis's default (``yes``)
    they answer ``CLUSTERDOWN`` for every slot once the cluster marks itself failed.
    ``replicas=1`` adds one replica per master (``nodes[num_masters:]``; which one becomes a
    master is ``redis-cli``'s choice, so tests ask a node's ``ROLE``): a stopped master's
    replica takes over its slots about one node timeout later."""

    def __init__(
        self, folder: Path, num_masters: int = 3, *, full_coverage: bool = True, replicas: int = 0
    ) -> None:
        self.nodes = []
        self.replicas = replicas
        taken: set[int] = set()  # every node's two ports distinct
        for i in range(num_masters * (1 + replicas)):
            node_dir = folder / f"node{i}"
            node_dir.mkdir()
            # the bus port is explicit: the default (port + 10000) overflows for a high port
            conf = str(node_dir / "nodes.conf")
            bus_port = _free_port(frozenset(taken))
            taken.add(bus_port)
            bus = str(bus_port)
            coverage = "yes" if full_coverage else "no"
            args = ("--cluster-enabled", "yes", "--cluster-config-file", conf,
                    "--cluster-node-timeout", "1000", "--cluster-port", bus,
                    "--cluster-require-full-coverage", coverage)  # fmt: skip
            node = RedisServer(node_dir, args)
            while node.port in taken:
                node.port = _free_port(frozenset(taken))
            taken.add(node.port)
            self.nodes.append(node)

    @property
    def url(self) -> str:
        """The URL the Redis tier takes for a cluster (any node; the client finds the rest)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.fail("redis-cli is not installed (apt-get install -y redis-tools)")
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        done = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + 20
        while not all(self._state_ok(cli, n.port) for n in self.nodes):
            if time.monotonic() > deadline:
                pytest.fail("the Redis cluster did not reach cluster_state:ok within 20 s")
            time.sleep(0.1)
        while self.replicas and not self._replication_settled(cli):
            if time.monotonic() > deadline:
                pytest.fail(f"the Redis cluster's replicas did not settle at {self.replicas} "
                            "per master with their links up within 20 s")  # fmt: skip
            time.sleep(0.1)

    def _replication_settled(self, cli: str) -> bool:
        """Whether every master has exactly ``replicas`` connected replicas and every replica
        its link up: right after ``--cluster create`` a replica can still be switching masters,
        and ``WAIT`` then counts it on the wrong one."""
        for node in self.nodes:
            out = subprocess.run(
                [cli, "-p", str(node.port), "info", "replication"],
                capture_output=True, text=True, check=False,
            ).stdout  # fmt: skip
            if "role:master" in out and f"connected_slaves:{self.replicas}" not in out:
                return False
            if "role:slave" in out and "master_link_status:up" not in out:
                return False
        return True

    @staticmethod
    def _state_ok(cli: str, port: int) -> bool:
        out = subprocess.run(
            [cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, check=False
        ).stdout
        return "cluster_state:ok" in out

    def name(self, index: int) -> str:
        """The node's ``host:port`` as the cluster (and redis-py) names it."""
        return f"127.0.0.1:{self.nodes[index].port}"

    def wait_state_ok(self, timeout_s: float = 20.0) -> None:
        """Wait until every running node reports ``cluster_state:ok``."""
        cli = shutil.which("redis-cli") or "redis-cli"
        deadline = time.monotonic() + timeout_s
        while not all(self._state_ok(cli, n.port) for n in self.nodes if n.proc is not None):
            if time.monotonic() > deadline:
                pytest.fail(f"the Redis cluster did not reach cluster_state:ok in {timeout_s} s")
            time.sleep(0.1)

    def dbsize(self, index: int) -> int:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.nodes[index].port), "dbsize"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return int(out.stdout.strip())

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A fresh 3-master Redis Cluster for one test, stopped afterwards."""
    cluster = RedisCluster(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_partial(tmp_path: Path) -> Iterator[RedisCluster]:
    """A 3-master cluster with ``cluster-require-full-coverage no`` (survivors keep serving)."""
    cluster = RedisCluster(tmp_path, full_coverage=False)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_replicated(tmp_path: Path) -> Iterator[RedisCluster]:
    """A 3-master cluster with one replica per master (6 servers): a lost master fails over."""
    cluster = RedisCluster(tmp_path, replicas=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
