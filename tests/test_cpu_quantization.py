"""CPU speed options: `threads` sets torch's thread count in the computing process; quantization="fp16"/"int8"
keep weights in fbgemm's formats. Each GEMM is checked against a brute-force reference (the same rounding of W
done by hand), and SmolLM2 with fp16 weights against HF transformers' fp32 greedy continuations."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams, errors
from minisgl.layers.linear import RESCORED, RESCORED_TOP, CpuGemm, quantize_gemms

pytestmark = pytest.mark.skipif(not CpuGemm.supports("fp16"), reason="no fbgemm kernels in this torch/CPU")


def test_fp16_gemm_equals_the_product_with_fp16_rounded_weights():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 64), torch.randn(96, 64) * 0.1, torch.randn(96)
    gemm = CpuGemm()
    gemm.quantized = "fp16"
    expected = x @ w.half().float().T + b
    torch.testing.assert_close(gemm(x, w, b), expected, rtol=1e-4, atol=1e-4)


def test_int8_gemm_is_within_the_rounding_of_7_bit_weights_and_8_bit_inputs_per_row():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 128), torch.randn(64, 128) * 0.05, torch.randn(64)
    x[1] *= 50  # an outlier row: the other rows keep their own resolution
    gemm = CpuGemm()
    gemm.quantized = "int8"
    scale = w.abs().amax(1, keepdim=True) / 63
    w_q = torch.round(w / scale) * scale  # the weights as 7-bit integers per output channel hold them
    for rows in (x, x[:1]):  # a prefill's rows, and one decode row
        x_step = 2 * rows.abs().amax(1, keepdim=True) / 255  # 8-bit inputs, each row over its own range
        expected = rows @ w_q.T + b
        bound = x_step / 2 * w_q.abs().sum(1) + 1e-4  # every input off by at most half a step
        assert ((gemm(rows, w, b) - expected).abs() <= bound).all()
        assert not torch.equal(gemm(rows, w, b), rows @ w.T + b)  # it really runs in int8


def test_a_changed_weight_is_packed_again():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    gemm = CpuGemm()
    gemm.quantized = "fp16"
    gemm(x, w)
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(gemm(x, w), x @ w.half().float().T, rtol=1e-4, atol=1e-4)


def test_int8_rescored_gemm_scores_each_rows_top_outputs_in_fp32_and_the_rest_in_int8():
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(500, 64) * 0.1
    gemm = CpuGemm()
    gemm.quantized = RESCORED
    y = gemm(x, w)
    exact = x @ w.T
    plain = CpuGemm()
    plain.quantized = "int8"
    approx = plain(x, w)
    for row in range(3):
        top = approx[row].topk(RESCORED_TOP).indices
        torch.testing.assert_close(y[row, top], exact[row, top], rtol=1e-5, atol=1e-5)  # fp32's own scores
        rest = torch.ones(500, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(y[row, rest], approx[row, rest])  # the int8 GEMM's elsewhere
    assert torch.equal(y.argmax(-1), exact.argmax(-1))


def test_int8_quantization_switches_every_linear_and_rescores_the_lm_head(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), quantization="int8", num_pages=256)
    kinds = {
        name.rsplit(".", 1)[-1]: module.gemm.quantized
        for name, module in llm.scheduler.engine.model.named_modules()
        if isinstance(getattr(module, "gemm", None), CpuGemm)
    }
    assert kinds == {
        "qkv_proj": "int8",
        "o_proj": "int8",
        "gate_up_proj": "int8",
        "down_proj": "int8",
        "lm_head": RESCORED,
    }
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_threads_sets_torch_threads_for_the_engine(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        LLM(str(tiny_model_dir("llama")), threads=1, num_pages=64)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "bad", [dict(threads=0), dict(quantization="int4"), dict(quantization="fp16", dtype="bfloat16")]
)
def test_bad_speed_options_are_refused(tiny_model_dir, bad):
    with pytest.raises(errors.ConfigError):
        LLM(str(tiny_model_dir("llama")), num_pages=64, **bad)


def test_quantize_gemms_refuses_a_kind_this_cpu_cannot_run(monkeypatch):
    monkeypatch.setitem(CpuGemm.quantized_ok, "int8", False)
    with pytest.raises(errors.ConfigError, match="int8"):
        quantize_gemms(torch.nn.Linear(2, 2), "int8")


def test_smollm2_fp16_weights_agree_with_hf_fp32_greedy(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def add(a, b):"]
    llm = LLM("smollm2", quantization="fp16", num_pages=512)
    hits = total = 0
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist()
        out = llm.generate([ref], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        for i in range(ids.shape[1], len(ref)):  # teacher forced: fp16's top-1 after HF's own prefix
            top = max(out.prompt_logprobs[i][1], key=lambda t: t[1])[0]
            hits += top == ref[i]
            total += 1
    assert hits / total >= 0.95, f"{hits}/{total}"
