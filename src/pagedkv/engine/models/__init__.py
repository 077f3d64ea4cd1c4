"""Model implementations (one module per family)."""

from pagedkv.engine.models.llama import LlamaModel

__all__ = ["LlamaModel"]
