#!/usr/bin/env bash
# The test command: set up (idempotent), then lint, type-check and run the whole test suite.
# The Redis tier tests start their own redis-server; it is installed here with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if ! command -v redis-server >/dev/null 2>&1; then
    echo "[test] installing redis-server (Debian package) for the Redis tier tests" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null) \
        || echo "[test] could not install redis-server: the Redis tier tests will fail" >&2
fi
. .venv/bin/activate
ruff check src tests benchmarks
ruff format --check src tests benchmarks
mypy
pytest -q "$@"
