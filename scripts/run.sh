#!/usr/bin/env bash
# The main job on an embedded default: set up (idempotent), then
#   1. `pagedkv demo`: the embedded real model (SmolLM2-135M-Instruct, a GGUF installed by
#      setup.sh) answers a multi-turn, shared-prefix chat workload through its chat template with
#      prefix caching off and on, and checks the outputs are identical (`--tiny`: a random model);
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
