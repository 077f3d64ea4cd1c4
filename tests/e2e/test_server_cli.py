"""``pagedkv serve`` as a user starts it: a child process that binds 127.0.0.1 unless told
otherwise and takes its API key from ``PAGEDKV_API_KEY``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from e2e.server_fixtures import spawned_server, write_endless_model
from pagedkv.server.cli import build_parser
from pagedkv.server.limits_cli import check_server_limits

pytestmark = pytest.mark.engine

KEY = "sk-from-the-environment"


def test_parser_binds_loopback_by_default() -> None:
    args = build_parser().parse_args(["--model", "some/dir"])
    assert args.host == "127.0.0.1"
    assert args.api_key is None  # the environment variable is read by main(), not here


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-request-bytes", "0"), ("--health-stall-timeout", "0"), ("--shutdown-timeout", "-1")],
)
def test_bad_server_limits_exit_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    args = parser.parse_args(["--model", "some/dir", flag, value])
    with pytest.raises(SystemExit) as exc:
        check_server_limits(parser, args)
    assert exc.value.code == 2  # a usage error, as every command exits
    assert flag in capsys.readouterr().err
    defaults = parser.parse_args(["--model", "some/dir"])
    check_server_limits(parser, defaults)  # the defaults are valid
    assert defaults.max_request_bytes == 8 << 20


def test_tool_call_flags_are_vllms_and_auto_needs_a_parser() -> None:
    from pagedkv.server.cli import main

    args = build_parser().parse_args(
        ["--model", "d", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
    with pytest.raises(SystemExit) as exc:  # a usage error, before loading a model
        main(["--model", "/nonexistent", "--enable-auto-tool-choice"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "d", "--tool-call-parser", "mistral"])


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4/IPv6 addresses (hex, as the kernel writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(addr)
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("srv-cli")
    model = write_endless_model(folder / "m")
    with spawned_server(model, folder / "serve.log", env={"PAGEDKV_API_KEY": KEY}) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, no 0.0.0.0 / ::
        yield base


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the Linux socket table")
def test_serve_uses_the_key_from_the_environment(served: str) -> None:
    assert httpx.get(f"{served}/v1/models", timeout=10).status_code == 401
    with openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0, timeout=30) as c:
        models = c.models.list()
        assert [m.id for m in models.data] == ["m"]  # the folder's name by default
        out = c.completions.create(model="m", prompt="hello", max_tokens=3, temperature=0)
        assert out.usage is not None
        assert out.usage.completion_tokens == 3
