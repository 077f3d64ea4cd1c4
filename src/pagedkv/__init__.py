"""pagedkv: a paged KV cache for LLM inference.

The core (``pagedkv.core``) needs only numpy and xxhash; the engine, server and tiers are extras.
"""

from pagedkv.errors import PagedKVError

__version__ = "0.1.0"

__all__ = ["PagedKVError", "__version__"]
