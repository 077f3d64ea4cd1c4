#!/usr/bin/env bash
# The main job on an embedded default: set up (idempotent), then
#   1. `pagedkv demo`: a tiny random-weight Llama built locally runs a multi-turn, shared-prefix
#      workload with prefix caching on and off and checks the outputs are identical;
#   2. `pagedkv simulate`: a built-in mixed workload replayed through the real scheduler and cache,
#      prefix caching on vs off (TTFT, inter-token latency, throughput, hit rate, usage).
# With arguments, runs that pagedkv command instead: ./scripts/run.sh simulate --help
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/pagedkv "$@"
fi
.venv/bin/pagedkv demo
echo
.venv/bin/pagedkv simulate
