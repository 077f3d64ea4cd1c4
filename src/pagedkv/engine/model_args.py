"""The flags of every command that runs a model (``generate``, ``serve``), with vLLM's names.

vLLM's names are the primary spelling; pagedkv's earlier spellings stay as aliases::

    MODEL (positional) | --model            the model folder
    --tokenizer DIR                         tokenizer.json etc. from another folder
    --dtype auto|float32|bfloat16|float16   (pagedkv.engine.dtype)
    --max-model-len N                       default: the model's max_position_embeddings
    --kv-cache-memory-bytes SIZE            the KV pool in bytes (512M, 2G); blocks derived
    --num-blocks N                          the KV pool in blocks (pagedkv's)
    --enable-prefix-caching / --no-enable-prefix-caching (alias --no-prefix-caching)
    --prefix-caching-hash-algo xxhash|sha256
    --num-speculative-tokens N              (alias --speculative-tokens)
    --chat-template FILE|TEMPLATE           --generation-config auto|vllm|DIR
    --seed N                                --threads N (torch intra-op threads)
    --quantization int8|gguf                int8 weight-only linears (pagedkv.engine.qlinear);
                                            gguf: keep a .gguf file's Q8_0/Q4_0/Q4_1 blocks
    --gguf-activations float32|int8         int8: 8-bit activations on those (engine.gguf_q8act)
    --linear-kernel torch|native            float32 few-row matmuls (engine.fewrow)
    --matmul-precision highest|medium       medium: bf16 linears on AMX (engine.bf16_dot)

Exit codes, the same for every command: 2 for bad usage (argparse's, also for a flag value
:class:`EngineConfig` rejects), 1 for a failure while running (a model folder that cannot be
loaded, a port in use). Messages go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedkv.engine.bf16_dot import MATMUL_PRECISION_CHOICES
from pagedkv.engine.dtype import DTYPE_CHOICES
from pagedkv.engine.engine_config import PREFIX_HASH_ALGOS, EngineConfig
from pagedkv.engine.fewrow import LINEAR_KERNEL_CHOICES
from pagedkv.engine.gguf_q8act import ACTIVATION_CHOICES
from pagedkv.engine.native import add_decode_kernel_argument
from pagedkv.engine.qlinear import QUANTIZATION_CHOICES
from pagedkv.errors import PagedKVError
from pagedkv.tiers.config import parse_bytes, tier_config_from_args


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except PagedKVError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model and engine flags (module docstring); the KV tier flags are
    ``pagedkv.tiers.config.add_tier_arguments``, which :func:`engine_config` reads."""
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="a local model folder or GGUF file"
    )
    parser.add_argument(
        "--model", default=None, help="the model folder or GGUF file (instead of MODEL)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="compute dtype (on a CPU bfloat16 is bf16 weights and KV cache with float32 "
        "compute: pagedkv.engine.dtype)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--max-model-len", type=_positive, default=None)
    parser.add_argument("--block-size", type=_positive, default=16)
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=_positive, default=None, help="KV pool in blocks")
    pool.add_argument(
        "--kv-cache-memory-bytes", type=_size, default=None, help="KV pool in bytes (2G, 512M)"
    )
    parser.add_argument("--max-num-seqs", type=_positive, default=64)
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--prefix-caching-hash-algo",
        choices=tuple(PREFIX_HASH_ALGOS),
        default="xxhash",
        help="the block hash: xxhash (XXH3-128, default) or sha256 (when untrusted tenants "
        "share one cache: a collision cannot be crafted)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--num-speculative-tokens", "--speculative-tokens", type=int, default=0, metavar="N"
    )
    add_decode_kernel_argument(parser)
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATION_CHOICES,
        help="int8: weight-only int8 linear layers, per output channel; gguf: a .gguf file's "
        "Q8_0/Q4_0/Q4_1 linears kept quantized (CPU, float32)",
    )
    parser.add_argument(
        "--gguf-activations",
        default="float32",
        choices=ACTIVATION_CHOICES,
        help="with --quantization gguf: float32 (exact, default) or int8 (activations rounded "
        "to 8 bits per block of 32 and integer dot products, as llama.cpp; faster, not exact)",
    )
    parser.add_argument(
        "--linear-kernel",
        default="torch",
        choices=LINEAR_KERNEL_CHOICES,
        help="float32 linear layers at 2..32 rows (decode): torch (torch.mm) or native (a "
        "batch-invariant C kernel that reads each weight once for all rows; CPU)",
    )
    parser.add_argument(
        "--matmul-precision",
        default="highest",
        choices=MATMUL_PRECISION_CHOICES,
        help="with --dtype bfloat16 on a CPU: highest (float32 arithmetic, default) or medium "
        "(linear layers in bf16 arithmetic on AMX, inputs rounded to bf16, and prompt "
        "attention in bf16; as highest where the CPU has no AMX)",
    )
    parser.add_argument(
        "--chat-template", default=None, help="a template file, or the template itself"
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="auto: the model's generation_config.json sampling defaults; vllm: none; or a DIR",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of unseeded requests")
    parser.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch intra-op threads (default: torch's; 1 is often faster on a busy CPU)",
    )


def model_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The model given positionally or by ``--model`` (usage error: neither, or two)."""
    pos, flag = args.model_pos, args.model
    if pos is not None and flag is not None and pos != flag:
        parser.error(f"the model is given twice: {pos!r} and --model {flag!r}")
    model = pos or flag
    if model is None:
        parser.error(
            "the model (a folder or a GGUF file) is required "
            "(pagedkv <command> MODEL, or --model MODEL)"
        )
    return str(model)


def engine_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of the flags; a value it rejects is a usage error (exit 2)."""
    try:
        return EngineConfig(
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_bytes=args.kv_cache_memory_bytes,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            num_speculative_tokens=args.num_speculative_tokens,
            decode_kernel=args.decode_kernel,
            quantization=args.quantization,
            gguf_activations=args.gguf_activations,
            linear_kernel=args.linear_kernel,
            matmul_precision=args.matmul_precision,
            chat_template=args.chat_template,
            generation_config=args.generation_config,
            tokenizer=args.tokenizer,
            seed=args.seed,
            tiers=tier_config_from_args(args),
        )
    except PagedKVError as exc:
        parser.error(str(exc))


def apply_threads(args: argparse.Namespace) -> None:
    """``--threads``: torch's intra-op thread count for this process."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def setup_logging(level: int | str) -> None:
    """Log records to stderr, each with its level once (``-v``, ``--log-level``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)


def fail(command: str, exc: BaseException | str) -> int:
    """Report a failure while running (one line on stderr); the exit code 1."""
    print(f"pagedkv {command}: error: {exc}", file=sys.stderr)
    return 1
