#!/usr/bin/env bash
# The test command: set up (idempotent), then lint, type-check and run the whole test suite.
# The Redis tier tests start their own redis-server, the native kernel needs a C compiler; both
# are installed here with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v redis-server >/dev/null 2>&1; then
    echo "[test] installing redis-server (Debian package) for the Redis tier tests" >&2
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null) \
        || echo "[test] could not install redis-server: the Redis tier tests will fail" >&2
fi
# The native decode kernel is compiled on first use; without a C compiler the engine falls
# back to torch's path and the kernel's tests are skipped, so install one when missing.
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    echo "[test] installing gcc (Debian package) for the native decode kernel" >&2
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq gcc libc6-dev >/dev/null) \
        || echo "[test] could not install gcc: the native kernel's tests will be skipped" >&2
fi
. .venv/bin/activate
ruff check src tests benchmarks
ruff format --check src tests benchmarks
mypy
pytest -q "$@"
