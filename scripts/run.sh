#!/usr/bin/env bash
# The main job on an embedded default: set up (idempotent), then run `pagedkv simulate`, which
# replays a built-in mixed workload through the real scheduler with prefix caching on and off.
# Extra arguments go to `pagedkv simulate` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/pagedkv simulate "$@"
