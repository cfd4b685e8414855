"""CPU speed options: `threads` sets torch's thread count in the computing process (physical cores by default);
quantization="fp16"/"int8" keep weights in layers/cpu_quant.py's formats. Each GEMM is checked against a brute-force
reference (the same rounding of W and x done by hand), and SmolLM2 with fp16 / int8 weights against HF transformers'
fp32 top-1 tokens."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Iterator

import pytest
import torch

from minisgl import LLM, SamplingParams, errors
from minisgl.engine.threads import cgroup_quota, default_threads
from minisgl.layers import cpu_kernel, cpu_quant
from minisgl.layers.cpu_quant import INT8_KERNEL_ROWS, RESCORED, RESCORED_TOP
from minisgl.layers.linear import CpuGemm, quantize_gemms

pytestmark = pytest.mark.skipif(not CpuGemm.supports("fp16"), reason="no fbgemm kernels in this torch/CPU")

# Held out: no text here was used to choose QUANTIZED_GEMMS (its figures came from other passages).
HELD_OUT = [
    "The Great Barrier Reef stretches for more than two thousand kilometres along the coast of Queensland. It is "
    "built by billions of tiny coral polyps, and warmer seas have bleached large parts of it several times since "
    "the late nineteen nineties.",
    "<|im_start|>user\nHow do I reverse a list in Python?<|im_end|>\n<|im_start|>assistant\nUse slicing: "
    "`reversed_list = my_list[::-1]` returns a new list, while `my_list.reverse()` reverses it in place.<|im_end|>",
    "Every morning the baker lit the wood oven before dawn. By six o'clock the first loaves were cooling on the "
    "racks, and a queue of neighbours had already formed outside the small shop on the corner of the square.",
    "A prime number has exactly two divisors, one and itself. The first few are two, three, five, seven, eleven "
    "and thirteen, and Euclid showed more than two thousand years ago that there are infinitely many of them.",
    "def word_counts(text):\n    counts = {}\n    for word in text.lower().split():\n        counts[word] = "
    "counts.get(word, 0) + 1\n    return sorted(counts.items(), key=lambda item: -item[1])\n",
]


def _int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T as the int8 kind defines it, in float64: W rounded to 127 steps of a float32 scale per group of
    cpu_kernel.GROUP inputs (per output channel where the width is not a multiple of it)."""
    n, k = w.shape
    group = cpu_kernel.GROUP if k % cpu_kernel.GROUP == 0 else k
    grouped = w.view(n, k // group, group)
    scale = (grouped.abs().amax(2) / 127).double()[..., None]
    w_q = (torch.round(grouped.double() / scale).clamp(-127, 127) * scale).view(n, k)
    return x.double() @ w_q.T


@pytest.mark.parametrize("rows", [1, 2, INT8_KERNEL_ROWS, INT8_KERNEL_ROWS + 3])
@pytest.mark.parametrize("k", [64, 40])  # 40: not a multiple of the group, so every row count is widened
def test_int8_gemm_is_the_product_of_int8_weights_and_float32_inputs(rows, k):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, k), torch.randn(48, k) * 0.05, torch.randn(48)
    w[3, 5] = 1.0  # an outlier weight: its group's scale grows, the other groups keep theirs
    gemm = CpuGemm()
    gemm.quantized = "int8"
    y = gemm(x, w, b).double()
    expected = _int8_reference(x, w) + b.double()
    # float32 sums, and the widened weights (more rows, or no kernel) through fp16 (11 bits).
    bound = (x.double().abs() @ w.double().abs().T) * 2**-11 + 1e-5
    assert ((y - expected).abs() <= bound).all()
    assert not torch.allclose(y, (x @ w.T + b).double(), rtol=1e-5, atol=1e-5)  # it really runs on int8 weights


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def omp_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's OpenMP threads (the kernel splits channels over them), whatever OMP_NUM_THREADS the run has."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_int8_kernel_builds_here_and_agrees_with_torch_at_each_row_count(omp_threads):
    """The machine's C compiler builds int8_gemm.c for this CPU; at 1..MAX_ROWS rows it computes the product of
    the int8 weights to float32 precision (where the fp16-widened path is only within 2^-11)."""
    kernel = cpu_kernel.load()
    assert kernel is not None, "int8_gemm.c did not build or failed its check (see the log)"
    torch.manual_seed(1)
    n, k = 40, cpu_kernel.GROUP * 5
    w = torch.randn(n, k) * 0.05
    q_ref = _int8_reference(torch.eye(k), w).T  # the rounded weights, float64 [n, k]
    scales = w.view(n, -1, cpu_kernel.GROUP).abs().amax(2) / 127
    q = torch.round(w.view(n, -1, cpu_kernel.GROUP) / scales[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    packed = kernel.pack(q, scales)
    for rows in range(1, cpu_kernel.MAX_ROWS + 1):
        x = torch.randn(rows, k)
        y = kernel.gemm(x, *packed).double()
        expected = x.double() @ q_ref.T
        assert ((y - expected).abs() <= (x.double().abs() @ q_ref.abs().T) * 2**-20 + 1e-6).all()
    with pytest.raises(ValueError, match="rows"):
        kernel.gemm(torch.randn(cpu_kernel.MAX_ROWS + 1, k), *packed)


def test_fp16_gemm_equals_the_product_with_fp16_rounded_weights():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 64), torch.randn(96, 64) * 0.1, torch.randn(96)
    gemm = CpuGemm()
    gemm.quantized = "fp16"
    expected = x @ w.half().float().T + b
    torch.testing.assert_close(gemm(x, w, b), expected, rtol=1e-4, atol=1e-4)


def test_dynamic_int8_gemm_is_within_the_rounding_of_7_bit_weights_and_8_bit_inputs_per_row():
    torch.manual_seed(0)
    x, w = torch.randn(3, 128), torch.randn(64, 128) * 0.05
    x[1] *= 50  # an outlier row: the other rows keep their own resolution
    packed = cpu_quant.pack(RESCORED, w, None)
    scale = w.abs().amax(1, keepdim=True) / 63
    w_q = torch.round(w / scale) * scale  # the weights as 7-bit integers per output channel hold them
    for rows in (x, x[:1]):  # a prefill's rows, and one decode row
        x_step = 2 * rows.abs().amax(1, keepdim=True) / 255  # 8-bit inputs, each row over its own range
        bound = x_step / 2 * w_q.abs().sum(1) + 1e-4  # every input off by at most half a step
        y = cpu_quant.run(RESCORED, rows, packed)
        assert ((y - rows @ w_q.T).abs() <= bound).all()
        assert not torch.equal(y, rows @ w.T)


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_a_changed_weight_is_packed_again(kind):
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    gemm = CpuGemm()
    gemm.quantized = kind
    gemm(x, w)
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(gemm(x, w), x @ w.T, rtol=0.02, atol=0.1)


def test_int8_rescored_gemm_scores_each_rows_top_outputs_in_fp32_and_the_rest_in_int8():
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(500, 64) * 0.1
    gemm = CpuGemm()
    gemm.quantized = RESCORED
    y = gemm(x, w)
    exact = x @ w.T
    approx = cpu_quant.run(RESCORED, x, cpu_quant.pack(RESCORED, w, None))
    for row in range(3):
        top = approx[row].topk(RESCORED_TOP).indices
        torch.testing.assert_close(y[row, top], exact[row, top], rtol=1e-5, atol=1e-5)  # fp32's own scores
        rest = torch.ones(500, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(y[row, rest], approx[row, rest])  # the int8 GEMM's elsewhere
    assert torch.equal(y.argmax(-1), exact.argmax(-1))


def test_int8_quantization_routes_each_linear_to_its_format(tiny_model_dir):
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


def test_threads_sets_torch_threads_for_the_engine(tiny_model_dir, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        LLM(str(tiny_model_dir("llama")), threads=1, num_pages=64)
        assert torch.get_num_threads() == 1
        LLM(str(tiny_model_dir("llama")), num_pages=64)  # the default: physical cores
        assert torch.get_num_threads() == default_threads()
    finally:
        torch.set_num_threads(before)


def test_default_threads_are_the_physical_cores_this_process_may_use():
    lscpu = shutil.which("lscpu")
    if lscpu is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("no lscpu or affinity masks here")
    if cgroup_quota() is not None:
        pytest.skip("a cgroup CPU quota caps the count")
    allowed = os.sched_getaffinity(0)
    rows = subprocess.run([lscpu, "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    cores = {
        tuple(row.split(",")[1:])
        for row in rows.splitlines()
        if row[:1].isdigit() and int(row.split(",")[0]) in allowed
    }
    assert default_threads() == len(cores)


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


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return tok, AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def _teacher_forced_agreement(llm: LLM, hf_smollm2, texts: list[str]) -> tuple[int, int]:
    """(positions where llm's top-1 next token equals HF fp32's, positions) over texts fed whole (teacher forced)."""
    tok, hf = hf_smollm2
    hits = total = 0
    for text in texts:
        ids = tok(text).input_ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate([ids], params, use_tqdm=False)[0]
        for i in range(1, len(ids)):  # prompt_logprobs[i]: the distribution of token i after ids[:i]
            top = max(out.prompt_logprobs[i][1], key=lambda t: t[1])[0]
            hits += top == expected[i - 1]
            total += 1
    return hits, total


def test_smollm2_int8_agrees_with_hf_fp32_top1_on_held_out_text(hf_smollm2):
    hits, total = _teacher_forced_agreement(LLM("smollm2", quantization="int8", num_pages=64), hf_smollm2, HELD_OUT)
    assert total >= 200
    print(f"int8 vs HF fp32, teacher-forced top-1: {hits}/{total}")
    assert hits / total >= 0.97, f"{hits}/{total}"


def test_smollm2_fp16_weights_agree_with_hf_fp32_top1(hf_smollm2):
    hits, total = _teacher_forced_agreement(LLM("smollm2", quantization="fp16", num_pages=64), hf_smollm2, HELD_OUT)
    assert hits / total >= 0.98, f"{hits}/{total}"
