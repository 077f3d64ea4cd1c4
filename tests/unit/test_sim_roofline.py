"""The roofline cost model against hand-computed rooflines, pool sizing as engines do it,
config.json parsing, and the CLI options that pick a cost source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sim import make_workload, simulate
from pagedkv.sim.cli import main
from pagedkv.sim.hardware import DEVICE_PRESETS, MODEL_PRESETS, DeviceSpec, ModelSpec, model_spec
from pagedkv.sim.roofline import RooflineCost, size_pool

# A toy model with round numbers: per layer q,o = 8*2*4 = 64 each, k,v = 8*1*4 = 32 each,
# MLP 3*8*16 = 384: 576 per layer, 1,152 linear weights; LM head 10*8 = 80.
TOY = ModelSpec("toy", 2, 8, 2, 1, 4, 16, 10)
DEV = DeviceSpec("toy", 1000.0, 100.0, 12_824, 10.0)  # FLOP/s, B/s, bytes, link B/s


def _exact(tp: int = 1) -> RooflineCost:
    return RooflineCost(
        TOY,
        DEV,
        tensor_parallel_size=tp,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        per_step_overhead_s=0.0,
        per_seq_overhead_s=0.0,
        link_latency_s=0.0,
    )


def test_toy_model_counts() -> None:
    assert TOY.num_linear_params == 1_152
    assert TOY.num_params == 1_152 + 2 * 80  # untied embedding and LM head
    assert TOY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 head of 4, bf16


def test_prefill_is_compute_bound_and_quadratic_in_context() -> None:
    # 100 tokens from position 0, one sampled row:
    #   linear: 2*1152*100 + 2*80 = 230,560 FLOPs = 230.56 s (weights 2,464 B = 24.64 s)
    #   attention: 100*101/2 = 5,050 pairs * 4*2*2*4 = 323,200 FLOPs = 323.2 s (KV 3,200 B = 32 s)
    t = _exact().step_time(100, 0, 100, 5_050, 1)
    assert t == pytest.approx(230.56 + 323.2)


def test_decode_is_memory_bound_weights_once_plus_kv_per_context_token() -> None:
    # 1 decode over 50 context tokens: weights 2,464 B = 24.64 s > 2,464 FLOPs = 2.464 s;
    # KV 50 * 32 B = 16 s > 3,200 FLOPs = 3.2 s.
    assert _exact().step_time(0, 1, 50, 50, 1) == pytest.approx(24.64 + 16.0)
    # A second sequence adds its KV only: the weights are read once per step.
    assert _exact().step_time(0, 2, 100, 100, 2) == pytest.approx(24.64 + 32.0)


def test_tensor_parallel_divides_and_adds_the_all_reduce() -> None:
    # T=2: weights 1,232 B per GPU = 12.32 s; the single KV head is replicated (32 B a token):
    # 16 s; all-reduce: 2 per layer of 1 token * 8 * 2 B * 2(T-1)/T = 16 B at 10 B/s = 1.6 s.
    assert _exact(2).step_time(0, 1, 50, 50, 1) == pytest.approx(12.32 + 16.0 + 4 * 1.6)


def test_overheads_and_efficiencies_apply() -> None:
    c = RooflineCost(
        TOY,
        DEV,
        compute_efficiency=0.5,
        memory_efficiency=0.5,
        per_step_overhead_s=1.0,
        per_seq_overhead_s=0.25,
    )
    assert c.step_time(0, 2, 100, 100, 2) == pytest.approx(2 * (24.64 + 32.0) + 1.0 + 0.5)
    assert c.step_time(0, 0) == 0.0


def test_llama3_8b_on_h100_matches_published_magnitudes() -> None:
    c = RooflineCost(MODEL_PRESETS["llama-3-8b"], DEVICE_PRESETS["H100"])
    n = 2048
    per_token = c.step_time(n, 0, n, n * (n + 1) // 2, 1) / n
    assert 20e-6 <= per_token <= 25e-6  # measured H100 prefill: ~23 µs/token
    decode = c.step_time(0, 1, 2000, 2000, 1)
    assert 5e-3 <= decode <= 8e-3  # 16 GB of weights at ~3 TB/s
    slower = RooflineCost(MODEL_PRESETS["llama-3-8b"], DEVICE_PRESETS["A100-80"])
    assert slower.step_time(n, 0, n, n * (n + 1) // 2, 1) / n == pytest.approx(
        per_token * 989.5 / 312, rel=0.1
    )


def test_pool_sizing_subtracts_weights_activations_and_runtime() -> None:
    # 12,824 B - weights (1,152 + 160) * 2 = 2,624 - activations 1 * (32 + 48) * 2 + 1*10*4 = 200
    # leaves 10,000 B; a block of 4 tokens is 128 B: 78 blocks.
    s = size_pool(
        _exact(),
        block_size=4,
        gpu_memory_utilization=1.0,
        max_num_batched_tokens=1,
        max_num_seqs=1,
        runtime_bytes=0,
    )
    assert (s.weight_bytes, s.activation_bytes, s.kv_bytes) == (2_624, 200, 10_000)
    assert s.num_blocks == 78


def test_a_model_that_does_not_fit_is_refused_with_the_numbers() -> None:
    c = RooflineCost(MODEL_PRESETS["llama-3-70b"], DEVICE_PRESETS["H100"])
    with pytest.raises(InvalidRequestError, match="GiB of weights"):
        size_pool(c, block_size=16)
    tp4 = RooflineCost(MODEL_PRESETS["llama-3-70b"], DEVICE_PRESETS["H100"], tensor_parallel_size=4)
    assert size_pool(tp4, block_size=16).num_blocks > 20_000
    with pytest.raises(InvalidRequestError, match="does not divide"):
        RooflineCost(MODEL_PRESETS["smollm2-135m"], DEVICE_PRESETS["H100"], tensor_parallel_size=2)


def test_config_json_gives_the_preset_shape(tmp_path: Path) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = model_spec(str(tmp_path))
    preset = MODEL_PRESETS["llama-3-8b"]
    assert (spec.num_params, spec.kv_bytes_per_token) == (preset.num_params, 131_072)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    with pytest.raises(InvalidRequestError, match="mixture-of-experts"):
        model_spec(str(tmp_path))
    with pytest.raises(InvalidRequestError, match="neither a preset"):
        model_spec("no-such-model")


def test_the_roofline_drives_the_simulator_deterministically() -> None:
    from pagedkv.sim import SimConfig

    w = make_workload("rag", num_requests=30, rate=20.0)
    h100 = SimConfig(cost=RooflineCost(MODEL_PRESETS["llama-3-8b"], DEVICE_PRESETS["H100"]))
    l4 = SimConfig(cost=RooflineCost(MODEL_PRESETS["llama-3-8b"], DEVICE_PRESETS["L4"]))
    a, b, slow = simulate(w, h100), simulate(w, h100), simulate(w, l4)
    assert a == b
    assert slow.tpot_s.p50 > 5 * a.tpot_s.p50  # 300 GB/s against 3,350 GB/s


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--device", "H100"], "--device needs --model-config"),
        (["--model-config", "llama-3-8b", "--per-step-ms", "2"], "--per-step-ms sets the constant"),
        (["--model-config", "llama-3-8b", "--device", "TPU"], "unknown device 'TPU'"),
        (["--model-config", "llama-3-70b"], "leaves no room for the KV cache"),
    ],
)
def test_cli_refuses_conflicting_cost_options(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--quiet"]) == 2
    assert fragment in capsys.readouterr().err


def test_cli_sizes_the_pool_from_the_model_and_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "r.json"
    argv = ["--model-config", "llama-3-8b", "--device", "A100-40", "--num-requests", "12"]
    assert main([*argv, "--compare", "caching=on", "--quiet", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "llama-3-8b on 1 x A100-40" in out
    doc = json.loads(js.read_text())
    num_blocks = doc["base"]["cache"]["num_blocks"]
    # (40 GiB * 0.9 - 15 GiB weights - activations - 1 GiB) / 2 MiB per 16-token block
    assert 9_000 < num_blocks < 10_500
    assert doc["base"]["cost"]["kind"] == "RooflineCost"


def test_throughput_saturates_at_the_capacity_the_cost_model_implies() -> None:
    from pagedkv.sim import SimConfig

    cfg = SimConfig(cost=RooflineCost(MODEL_PRESETS["llama-3-8b"], DEVICE_PRESETS["L4"]))
    tput = {}
    for rate in (0.5, 20.0, 80.0):
        w = make_workload("system", num_requests=80, rate=rate, max_tokens="oracle")
        tput[rate] = simulate(w, cfg).requests_per_s
    assert tput[0.5] == pytest.approx(0.5, rel=0.35)  # below capacity: throughput = load
    assert tput[20.0] < 20.0 * 0.8  # past it: the engine, not the load, sets the pace
    assert tput[80.0] == pytest.approx(tput[20.0], rel=0.15)  # and more load adds nothing


def test_device_and_tp_variants_resize_a_memory_sized_pool() -> None:
    from pagedkv.sim import SimConfig, build_variants
    from pagedkv.sim.roofline import MemoryPool

    llama = MODEL_PRESETS["llama-3-8b"]
    roof = RooflineCost(llama, DEVICE_PRESETS["H100"])
    base = SimConfig(cost=roof, memory_pool=MemoryPool(roof, 0.9))
    vs = build_variants(base, ["device=H100,A100-40", "block_size=16,64"])
    blocks = {(v.cost.device.name, v.cache.block_size): v.cache.num_blocks for v in vs}  # type: ignore[attr-defined]
    for (device, bs), n in blocks.items():
        want = size_pool(RooflineCost(llama, DEVICE_PRESETS[device]), block_size=bs)
        assert n == want.num_blocks  # the same bytes, as an engine sizes it
    assert blocks[("H100", 16)] > 2 * blocks[("A100-40", 16)]
    (tp2,) = build_variants(base, ["tensor_parallel_size=2"])
    assert tp2.cache.num_blocks > 2 * blocks[("H100", 16)]  # half the weights and KV per GPU
    with pytest.raises(InvalidRequestError, match="give --model-config"):
        build_variants(SimConfig(), ["device=L4"])
    roof70 = RooflineCost(MODEL_PRESETS["llama-3-70b"], DEVICE_PRESETS["H100"], 4)
    tp4 = SimConfig(cost=roof70, memory_pool=MemoryPool(roof70))
    with pytest.raises(InvalidRequestError, match="no room for the KV cache"):
        build_variants(tp4, ["tensor_parallel_size=1"])  # 140 GB of weights on one H100
