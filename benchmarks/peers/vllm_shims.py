"""Stand-ins for the vLLM modules that its KV cache manager imports but a benchmark never uses.

Each function fills one module with only the names the loaded vLLM modules import from it:
a logger factory, config and request types (as placeholders), flags read at import time.
No vLLM code is copied here.
"""

from __future__ import annotations

import enum
import logging
import types
from collections.abc import Callable

from peers._loader import placeholder


def _names(*names: str) -> Callable[[types.ModuleType], None]:
    def fill(module: types.ModuleType) -> None:
        for n in names:
            setattr(module, n, placeholder(n))

    return fill


def _logger(module: types.ModuleType) -> None:
    module.init_logger = logging.getLogger  # type: ignore[attr-defined]


def _config(module: types.ModuleType) -> None:
    _names("VllmConfig", "CacheConfig", "ModelConfig", "SchedulerConfig")(module)
    module.get_current_vllm_config_or_none = lambda: None  # type: ignore[attr-defined]


def _platforms(module: types.ModuleType) -> None:
    class _Platform:
        """A platform with no custom KV cache specs (a plain CUDA/CPU decoder)."""

        def register_custom_kv_cache_specs(self, vllm_config: object) -> None:
            return None

    module.current_platform = _Platform()  # type: ignore[attr-defined]


def _envs(module: types.ModuleType) -> None:
    module.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True  # type: ignore[attr-defined]


def _mm_utils(module: types.ModuleType) -> None:
    def get_mm_features_in_window(*args: object, **kwargs: object) -> object:
        raise NotImplementedError("multimodal inputs are not part of the benchmark")

    module.get_mm_features_in_window = get_mm_features_in_window  # type: ignore[attr-defined]


def _v1_utils(module: types.ModuleType) -> None:
    def tensor_data(*args: object) -> object:
        raise NotImplementedError("prompt embeddings are not part of the benchmark")

    module.tensor_data = tensor_data  # type: ignore[attr-defined]


def _torch_utils(module: types.ModuleType) -> None:
    def get_dtype_size(dtype: object) -> int:
        import torch

        return int(torch.tensor([], dtype=dtype).element_size())  # type: ignore[arg-type]

    module.get_dtype_size = get_dtype_size  # type: ignore[attr-defined]


def _import_utils(module: types.ModuleType) -> None:
    def resolve_obj_by_qualname(qualname: str) -> object:
        raise NotImplementedError(f"{qualname}: attention backends are not part of the benchmark")

    module.resolve_obj_by_qualname = resolve_obj_by_qualname  # type: ignore[attr-defined]


def _request(module: types.ModuleType) -> None:
    class RequestStatus(enum.IntEnum):
        """Only the members the KV cache manager compares against."""

        WAITING = enum.auto()
        WAITING_FOR_REMOTE_KVS = enum.auto()
        RUNNING = enum.auto()
        PREEMPTED = enum.auto()

    module.Request = placeholder("Request")  # type: ignore[attr-defined]
    module.RequestStatus = RequestStatus  # type: ignore[attr-defined]


def _kv_events(module: types.ModuleType) -> None:
    _names("AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent", "KVEventBatch")(
        module
    )
    module.MEDIUM_GPU = "GPU"  # type: ignore[attr-defined]
    module.MEDIUM_CPU = "CPU"  # type: ignore[attr-defined]


SHIMS: dict[str, Callable[[types.ModuleType], None]] = {
    "vllm.logger": _logger,
    "vllm.envs": _envs,
    "vllm.config": _config,
    "vllm.platforms": _platforms,
    "vllm.multimodal.utils": _mm_utils,
    "vllm.v1.utils": _v1_utils,
    "vllm.utils.torch_utils": _torch_utils,
    "vllm.utils.import_utils": _import_utils,
    "vllm.v1.request": _request,
    "vllm.distributed.kv_events": _kv_events,
    "vllm.v1.metrics.stats": _names("PrefixCacheStats", "KVCacheEvictionEvent"),
}

REAL = (
    "vllm.utils.math_utils",
    "vllm.utils.hashing",
    "vllm.utils.gc_utils",
    "vllm.utils.collection_utils",
    "vllm.v1.token_buffer",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.hisparse.block_pool",
)
