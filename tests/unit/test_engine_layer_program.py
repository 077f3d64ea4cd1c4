"""A decode step's layer loop as native segments (engine/step_program.py, csrc/step_program.c,
models/layer_program.py).

The properties pinned: a decode run gives the same tokens and log-probabilities, bit for bit,
with the program as with the Python loop, for every layer type the program takes (int8, bf16
highest, bf16 medium, GGUF blocks with float32 and 8-bit activations), at 1 and 2 threads, with
requests of different lengths joining and leaving; a float32 model (torch.mm) keeps the Python
loop; a segment stops at the first call that fails, reports it, and makes no later call; a
call recorded with the wrong number of arguments for its prototype is refused."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from differential.gguf_files import write_tiny_gguf
from pagedkv.engine import bf16_dot, bf16_linear, gguf_q8act, layer_ops, qlinear, step_program
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.step_program import Recorded, StepProgram, record
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError

pytestmark = pytest.mark.skipif(
    not (step_program.available() and layer_ops.available() and qlinear.available()),
    reason="native kernels unavailable",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("program") / "m", hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, eos_token_id=None,
    )  # fmt: skip


def _run(engine: LLMEngine) -> dict[str, list[tuple[int, float]]]:
    """Three requests of different lengths, the third joining two steps late, so the steps'
    block tables, lengths and sequence counts change while the program runs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = {"a": [5, 9, 14, 3, 22, 7], "b": list(range(3, 40)), "c": [8] * 19}
    got: dict[str, list[tuple[int, float]]] = {}
    for rid in ("a", "b"):
        engine.add_request(rid, prompts[rid], params)
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 2:
            engine.add_request("c", prompts["c"], params)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [
                    (t.token_id, t.logprob) for t in out.outputs[0].logprobs or ()
                ]
        steps += 1
    return got


def _programs_used(engine: LLMEngine) -> int:
    return sum(p is not None for _, p in engine.model._programs.values())


def _same_with_and_without(path: Path, cfg: EngineConfig, fused_mlp: bool = False) -> None:
    ours = LLMEngine.from_model_dir(str(path), cfg)
    got = _run(ours)
    assert _programs_used(ours) > 0  # the program ran
    if fused_mlp:  # with the one-call MLP in place of gate/up, SiLU and down
        assert all(p is None or p.fused_mlp for _, p in ours.model._programs.values())
    if layer_ops._silu_ready():  # and SiLU inside it, where it gives torch's bits
        assert any(p and p.native_silu for _, p in ours.model._programs.values())
    python = LLMEngine.from_model_dir(str(path), cfg)
    python.model.step_program = False
    assert _run(python) == got  # token ids and log-probabilities, bit for bit
    assert _programs_used(python) == 0


@pytest.mark.parametrize(
    ("dtype", "quantization", "precision"),
    [("float32", "int8", "highest"), ("bfloat16", None, "highest"), ("bfloat16", None, "medium")],
)
def test_a_decode_run_is_the_same_with_and_without_the_program(
    model_dir: Path, dtype: str, quantization: str | None, precision: str, threads: int
) -> None:
    if dtype == "bfloat16" and not bf16_linear.available():
        pytest.skip("no bf16 kernel")
    if precision == "medium" and not bf16_dot.amx():
        pytest.skip("no AMX-BF16")
    cfg = EngineConfig(
        num_blocks=64, dtype=dtype, quantization=quantization, matmul_precision=precision
    )
    _same_with_and_without(model_dir, cfg, precision == "medium" and bf16_dot.mlp_ready())


def test_an_intermediate_size_off_the_vector_width_is_the_same(
    tmp_path: Path, threads: int
) -> None:
    """SiLU over 100 columns: three 32-column steps, then four one by one (torch's tail)."""
    path = write_tiny_model(
        tmp_path / "m", hidden_size=64, intermediate_size=100, num_hidden_layers=2,
        eos_token_id=None,
    )  # fmt: skip
    _same_with_and_without(path, EngineConfig(num_blocks=64, quantization="int8"))


def test_native_silu_is_checked_per_thread_count() -> None:
    if not layer_ops._silu_ready():
        pytest.skip("no native SiLU here")
    now = torch.get_num_threads()
    assert layer_ops.silu_matches_torch(16, 1536, now)
    assert not layer_ops.silu_matches_torch(16, 1536, now + 1)  # bound for another count
    torch.set_num_threads(now + 1)
    try:  # that answer was not kept: at that count the check runs and passes
        assert layer_ops.silu_matches_torch(16, 1536, now + 1)
    finally:
        torch.set_num_threads(now)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_gguf_decode_run_is_the_same_with_and_without_the_program(
    tmp_path: Path, activations: str, threads: int
) -> None:
    if activations == "int8" and gguf_q8act._native.load() is None:
        pytest.skip("no int8-activation kernel")
    path, _ = write_tiny_gguf(tmp_path, tensor_type="Q4_1")
    cfg = EngineConfig(num_blocks=64, quantization="gguf", gguf_activations=activations)
    _same_with_and_without(path, cfg)


def test_a_float32_model_keeps_the_python_loop(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig(num_blocks=64))
    _run(engine)
    assert engine.model._programs  # tried once per kept buffer set ...
    assert _programs_used(engine) == 0  # ... and refused: torch.mm has no native form


def _norm_call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Recorded:
    lib = layer_ops.library()
    fn = lib["pagedkv_rms_norm_f32"]
    rows, d = x.shape
    args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(d), ctypes.c_void_p(w.data_ptr()),
            ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(d),
            ctypes.c_float(1e-5), ctypes.c_int64(layer_ops.vector_width())]  # fmt: skip
    rec = record(fn, args)
    assert rec is not None
    return rec


def test_a_segment_runs_in_order_and_stops_at_the_first_failure() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 64, generator=gen), torch.randn(64, generator=gen)
    first, second, third = (torch.full((2, 64), float("nan")) for _ in range(3))
    good = _norm_call(x, w, first)
    chained = _norm_call(first, w, second)  # reads the first call's output
    bad = good._replace(words=(*good.words[:4], -1, *good.words[5:]))  # rows = -1: refused
    after = _norm_call(x, w, third)
    program = StepProgram([[good, chained], [bad, after]])
    assert program.num_segments == 2
    assert program.run(0) == -1
    expected = torch.empty(2, 64)
    layer_ops.rms_norm(x, w, 1e-5, expected)
    assert torch.equal(first, expected)
    layer_ops.rms_norm(expected, w, 1e-5, expected)
    assert torch.equal(second, expected)  # in order: it saw the first call's output
    assert program.run(1) == 2  # the failing call's index among all calls
    assert torch.isnan(third).all()  # the call after the failure was not made


def test_a_call_with_the_wrong_arity_or_an_unknown_symbol_is_refused() -> None:
    x, w, out = torch.randn(1, 64), torch.randn(64), torch.empty(1, 64)
    good = _norm_call(x, w, out)
    with pytest.raises(InvalidRequestError, match="prototype takes"):
        StepProgram([[good._replace(words=good.words[:-1])]])
    with pytest.raises(InvalidRequestError, match="prototype takes"):
        StepProgram([[good._replace(floats=())]])
    lib = layer_ops.library()
    assert record(lib["pagedkv_argmax_f32"], []) is None  # no prototype for it here


@pytest.mark.parametrize("kind", ["mistral_swa", "qwen2_swa", "qwen3_swa"])
def test_sliding_window_layers_are_the_same_with_and_without_the_program(
    tmp_path: Path, kind: str
) -> None:
    """Window layers attend through their own view (two distinct decode calls in a step where
    only some layers have a window; Qwen3's q/k norms inside RoPE): every layer's call is
    patched per step, and the bits equal the Python loop's."""
    pytest.importorskip("transformers")
    from differential.hf_models import build_hf_model

    build_hf_model(kind, tmp_path)
    _same_with_and_without(tmp_path, EngineConfig(num_blocks=64, quantization="int8"))


def test_a_failing_kernel_in_a_step_raises_its_own_message(model_dir: Path) -> None:
    """A segment's failure names the call that failed (here RoPE's K/V write, handed a slot
    outside the cache), as the Python loop's call would."""
    engine = LLMEngine.from_model_dir(
        str(model_dir), EngineConfig(num_blocks=64, quantization="int8")
    )
    _run(engine)
    buf, (_, program) = next((b, kp) for b, kp in engine.model._programs.items() if kp[1])
    assert program is not None
    with torch.inference_mode():
        buf.slots.fill_(10**9)
    with pytest.raises(InvalidRequestError, match=r"rope_write: a slot is outside \[0, "):
        program.run(0)
