#!/usr/bin/env bash
# The test command: set up (idempotent), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks
ruff format --check src tests benchmarks
mypy
pytest -q "$@"
