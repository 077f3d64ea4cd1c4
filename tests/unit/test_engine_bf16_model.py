"""A bfloat16 model on a CPU: bf16 weights, float32 compute (models/llama.py, bf16_linear.py).

The property pinned: with the same KV cache dtype, a bf16-weight model computes the float32
model's arithmetic on the same (exactly widened) weights. The float32 model with
``linear_kernel='native'`` sums every 2..32-row matmul in the bf16 kernel's order, so the two
give bit-identical log-probabilities on steps of 2..32 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from differential.engine_runs import drain
from pagedkv.engine import bf16_linear
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.engine.models.projection import Bf16Projection, Linear
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not bf16_linear.available(), reason="no C compiler")

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 2, 8, 8, 31], [17, 11, 4, 29, 6, 12, 2]]  # 18 rows


def _run(engine: LLMEngine, new: int) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy tokens with their log-probabilities, the prompts together."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    got, _ = drain(engine)
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def _widened_model(model_dir: Path) -> LlamaModel:
    """The float32 model over the bf16 model's weights: the checkpoint rounded to bf16 and
    widened back (exact), so it computes on the same values."""
    ckpt = load_model(model_dir)
    return LlamaModel(ckpt.config, {n: t.bfloat16().float() for n, t in ckpt.weights.items()})


def _linear_names(model: LlamaModel) -> list[tuple[list[Linear], list[list[str]]]]:
    """Each group of linear layers with the checkpoint names each layer joins."""
    layers = range(model.config.num_hidden_layers)
    a, m = "model.layers.{}.self_attn.{}_proj.weight", "model.layers.{}.mlp.{}_proj.weight"
    return [
        (model._qkv, [[a.format(i, x) for x in "qkv"] for i in layers]),
        (model._o, [[a.format(i, "o")] for i in layers]),
        (model._gate_up, [[m.format(i, x) for x in ("gate", "up")] for i in layers]),
        (model._down, [[m.format(i, "down")] for i in layers]),
    ]


def _joined(model: LlamaModel, names: list[str]) -> torch.Tensor:
    """The named ``[out, in]`` weights joined as a layer's ``[in, sum(out)]``."""
    return torch.cat([model.weights[n] for n in names]).t()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("bf16") / "m", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, eos_token_id=None,
    )  # fmt: skip


def test_bf16_weights_compute_the_float32_models_arithmetic(model_dir: Path) -> None:
    bf16 = load_model(model_dir, dtype="bfloat16")
    assert bf16.dtype is torch.bfloat16
    assert bf16.compute_dtype is torch.float32
    fp32 = _widened_model(model_dir)
    cfg = EngineConfig(num_blocks=64, dtype="float32")  # both KV caches float32
    ours = _run(LLMEngine(bf16, None, cfg), 6)
    ref = _run(LLMEngine(fp32, None, EngineConfig(num_blocks=64, linear_kernel="native")), 6)
    assert ours == ref  # token ids and log-probabilities, bit for bit


def test_bfloat16_keeps_bf16_weights_and_a_bf16_kv_cache(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig(num_blocks=64, dtype="bfloat16"))
    model = engine.model
    assert engine.runner.kv_cache.k[0].dtype is torch.bfloat16
    ckpt = load_model(model_dir)  # float32, as the file holds it
    for group, names in _linear_names(model):
        for p, name in zip(group, names, strict=True):
            assert isinstance(p, Bf16Projection)
            assert p.weight.tiles.dtype is torch.bfloat16  # half the float32 bytes
            assert p.bias is None or p.bias.dtype is torch.float32
            assert torch.equal(p.weight.weight_t(), _joined(ckpt, name).bfloat16())
            assert not any(n in model.weights for n in name)  # the tiles replace them
    assert model.lm_head.dtype is torch.bfloat16
    ours = _run(engine, 6)
    # against the float32 model on the same weights: the KV cache rounding to bf16 is the only
    # difference, so on this tiny model the greedy tokens agree and log-probs stay close
    fp32 = _widened_model(model_dir)
    ref = _run(LLMEngine(fp32, None, EngineConfig(num_blocks=64)), 6)
    assert [[t for t, _ in r] for r in ours] == [[t for t, _ in r] for r in ref]
    diff = max(abs(a - b) for r, s in zip(ours, ref, strict=True)
               for (_, a), (_, b) in zip(r, s, strict=True))  # fmt: skip
    assert diff < 0.05, diff


def test_the_fused_layer_ops_write_a_bf16_cache_as_the_torch_ops_do(model_dir: Path) -> None:
    """RoPE + the K/V write in C round k and v to bf16 as ``PagedKVCache.write``'s cast does
    (nearest even), so the fused forward over a bf16 cache gives the torch forward's bits."""
    cfg = EngineConfig(num_blocks=64, dtype="bfloat16")
    fused = LLMEngine.from_model_dir(str(model_dir), cfg)
    assert fused.model.fused_layer_ops
    plain = LLMEngine.from_model_dir(str(model_dir), cfg)
    plain.model.fused_layer_ops = False
    assert _run(fused, 5) == _run(plain, 5)
    k = fused.runner.kv_cache.k[0]
    assert bool((k != 0).any())  # the fused path did write the cache


def test_float32_compute_over_bf16_weights_is_its_own_cache_namespace(model_dir: Path) -> None:
    """Torch's bf16 ops (where the kernel does not build) write other bf16 KV than float32
    compute over the same weights: the two never share a hash root or a tier key."""
    bf16 = load_model(model_dir, dtype="bfloat16")
    engine = LLMEngine(bf16, None, EngineConfig(num_blocks=16, model_id="m"))
    assert engine.config.model_id == "m+compute=float32"
    assert engine.scheduler.manager.config.model_id == "m+compute=float32"
    fp32 = LLMEngine(load_model(model_dir), None, EngineConfig(num_blocks=16, model_id="m"))
    assert fp32.config.model_id == "m"


def test_prefix_caching_gives_the_same_log_probabilities_bit_for_bit(model_dir: Path) -> None:
    """Where prefill runs the kernel 32 rows at a time (``bf16_linear.kernel_prefill``), a
    row's bits do not depend on how many rows its step computes, so prompts of more than 32
    tokens sharing a 48-token prefix get the same tokens and log-probabilities, bit for bit,
    with the prefix computed again (caching off) or served from the cache (caching on, after a
    first pass filled it)."""
    if not bf16_linear.kernel_prefill():
        pytest.skip("prefill widens the weights for torch.mm on this build (portable C)")
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 60, (48,), generator=gen).tolist()
    prompts = [prefix + torch.randint(2, 60, (n,), generator=gen).tolist() for n in (22, 9, 30)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

    def run(caching: bool, passes: int) -> list[list[tuple[int, float]]]:
        cfg = EngineConfig(num_blocks=64, dtype="bfloat16", enable_prefix_caching=caching)
        engine = LLMEngine.from_model_dir(str(model_dir), cfg)
        for p in range(passes):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"p{p}r{i}", prompt, params)
            got, cached = drain(engine)
        assert (cached >= 3 * 48) is caching  # the last pass was served the shared prefix
        return [got[f"p{passes - 1}r{i}"] for i in range(len(prompts))]

    assert run(caching=True, passes=2) == run(caching=False, passes=1)
