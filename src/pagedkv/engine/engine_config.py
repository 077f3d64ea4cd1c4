"""The engine's configuration: built once at the edge (CLI, server, ``LLM(...)``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.config import check_invariants_default
from pagedkv.core.hashing import HashAlgo
from pagedkv.engine.bf16_dot import check_matmul_precision
from pagedkv.engine.fewrow import check_linear_kernel
from pagedkv.engine.gguf_q8act import check_activations
from pagedkv.engine.kv_cache import parse_dtype
from pagedkv.engine.qlinear import check_quantization
from pagedkv.errors import InvalidRequestError
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.tiers.config import TierConfig

PREFIX_HASH_ALGOS = {"xxhash": HashAlgo.XXH3_128, "sha256": HashAlgo.SHA256}
"""``prefix_caching_hash_algo``'s values (vLLM's names) and the block hash each selects."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes and switches of one engine.

    KV blocks: ``num_blocks`` when given, else as many as fit in ``kv_cache_bytes``, else 1024.
    ``initial_blocks`` below that makes the pool (and the KV tensors) grow on demand.
    ``num_speculative_tokens > 0`` turns on prompt-lookup speculative decoding.
    ``tiers`` adds KV tiers below the device pool (host RAM, local disk, Redis); the engine
    builds their offload coordinator and closes it in ``LLMEngine.close()``.
    ``tune_host_allocator`` (CPU only) raises glibc's malloc thresholds for the whole process
    so each step's large activations are reused, not page-faulted in again
    (``pagedkv.engine.host_alloc``). ``decode_kernel`` picks the batched decode attention:
    ``"torch"`` (gather + SDPA), ``"native"`` (the C kernel, CPU float32; an error when it
    cannot be built) or ``"auto"``: the native kernel for a CPU float32 model when it builds,
    torch's path otherwise. ``freeze_gc_heap`` moves
    every object alive when the
    engine is built out of Python's cyclic collector (``gc.freeze()``), so collections while
    serving don't rescan the model and the imported libraries. ``quantization="int8"``
    keeps the linear layers' weights int8 per output channel (CPU, float32 only:
    ``pagedkv.engine.qlinear``); ``quantization="gguf"`` keeps a .gguf file's Q8_0/Q4_0/Q4_1
    linears as its blocks, and with ``gguf_activations="int8"`` they compute with 8-bit
    activations (llama.cpp's arithmetic, not exact: ``pagedkv.engine.gguf_q8act``).
    ``linear_kernel="native"`` runs the float32 linear layers
    and vocabulary projection at 2..32 rows (decode steps) through a batch-invariant C kernel
    (``pagedkv.engine.fewrow``; CPU float32), ``"torch"`` keeps ``torch.mm``.
    ``matmul_precision="medium"`` (``dtype="bfloat16"`` on a CPU) runs the linear layers and
    the vocabulary projection in bf16 arithmetic on AMX, their inputs rounded to bf16, and
    the prompt's attention in bf16 (``pagedkv.engine.bf16_dot``; as ``highest`` where the CPU
    has no AMX, with a warning);
    ``"highest"`` keeps float32 arithmetic.

    Resolved by ``LLMEngine.from_model_dir`` from the checkpoint: ``dtype="auto"`` (float32 on
    a CPU, the checkpoint's dtype on CUDA: ``pagedkv.engine.dtype``), ``model_id=""`` (the
    checkpoint's content fingerprint, which seeds the prefix-hash root and names the tiers'
    namespace), ``max_model_len=None`` (the model's ``max_position_embeddings``; a larger value
    is refused), ``chat_template`` (a file or an inline template, replacing the checkpoint's),
    ``generation_config`` (``"auto"``: the checkpoint's ``generation_config.json`` sampling
    defaults; ``"vllm"``: none; or a folder). ``seed`` seeds requests that bring none.
    ``kv_events`` publishes the pool's and the tiers' KV events over ZeroMQ
    (``pagedkv.kvevents``; needs pyzmq, msgspec).
    """

    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16" (pagedkv.engine.dtype)
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    initial_blocks: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    # vLLM's names: "xxhash" (XXH3-128, fast) or "sha256" (when untrusted tenants share a cache)
    prefix_caching_hash_algo: str = "xxhash"
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    batched_decode: bool = True
    decode_kernel: str = "auto"  # "auto" | "torch" | "native" (see pagedkv.engine.native)
    quantization: str | None = None  # None | "int8" | "gguf" (pagedkv.engine.qlinear)
    gguf_activations: str = "float32"  # "float32" | "int8" (gguf only: engine.gguf_q8act)
    linear_kernel: str = "torch"  # "torch" | "native": few-row fp32 matmuls (engine.fewrow)
    matmul_precision: str = "highest"  # "highest" | "medium": bf16 on AMX (engine.bf16_dot)
    watermark: float = 0.01
    reservation: str = "max_tokens"
    model_id: str = ""  # default: the checkpoint's fingerprint (pagedkv.engine.fingerprint)
    tokenizer: str | None = None  # a folder with tokenizer.json (default: the model folder)
    chat_template: str | None = None  # a file or an inline template (as vLLM's --chat-template)
    generation_config: str = "auto"  # "auto" | "vllm" | a folder (pagedkv.engine.generation_config)
    seed: int | None = None  # seeds the draws of requests that give no seed of their own
    tiers: TierConfig | None = None
    kv_events: KVEventsConfig | None = None
    tune_host_allocator: bool = True
    freeze_gc_heap: bool = True
    check_invariants: bool = field(default_factory=check_invariants_default)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidRequestError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise InvalidRequestError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.num_speculative_tokens < 0:
            raise InvalidRequestError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if self.decode_kernel not in ("auto", "torch", "native"):
            raise InvalidRequestError(
                f"decode_kernel must be 'auto', 'torch' or 'native', got {self.decode_kernel!r}"
            )
        if self.prefix_caching_hash_algo not in PREFIX_HASH_ALGOS:
            raise InvalidRequestError(
                "prefix_caching_hash_algo must be 'sha256' or 'xxhash', got "
                f"{self.prefix_caching_hash_algo!r} (vLLM's *_cbor variants are not supported)"
            )
        if self.dtype != "auto":
            parse_dtype(self.dtype)  # raises InvalidRequestError naming the choices
        check_quantization(self.quantization, self.dtype, self.device)
        check_activations(self.gguf_activations, self.quantization)
        check_linear_kernel(self.linear_kernel, self.device, self.quantization)
        check_matmul_precision(self.matmul_precision, self.dtype, self.device, self.quantization)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InvalidRequestError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.tokenizer is not None and not self.tokenizer:
            raise InvalidRequestError("tokenizer must be a folder, got ''")
        if self.chat_template is not None and not self.chat_template:
            raise InvalidRequestError("chat_template must be a file path or a template, got ''")
        if not self.generation_config:
            raise InvalidRequestError("generation_config must be 'auto', 'vllm' or a folder")
        if self.seed is not None and (isinstance(self.seed, bool) or self.seed < 0):
            raise InvalidRequestError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
