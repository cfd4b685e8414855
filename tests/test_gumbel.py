"""The one-pass temperature sampling kernel (engine/gumbel.py) against softmax(logits / T).

The reference is the exact distribution: many draws of one row (a batch of identical rows, each drawing
its own noise) must fit softmax(logits / T) by a chi-square test. On a CUDA machine the kernel runs
compiled (and through Sampler, as the engine calls it); on any machine with Triton it also runs in
Triton's interpreter in a fresh process (see tests/test_fused_qkv.py for why a fresh process).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHI2_LIMIT = {7: 29.9, 15: 42.0}  # chi-square quantiles at p = 1e-4 (degrees of freedom -> limit)
ROWS = {"cuda": 4000, "cpu": 1000}  # draws per distribution (the interpreter runs ~10 ms a program)


def test_the_kernel_in_triton_interpreter_on_the_cpu():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if INTERPRETED:
        pytest.skip("this process is the interpreter run itself")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "cpu-interpreter"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parent.parent, capture_output=True,
        text=True, timeout=600,
    )
    assert result.returncode == 0 and "5 passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-interpreter", "cuda"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    from minisgl.engine import gumbel

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if request.param == "cpu" and not INTERPRETED:
        pytest.skip("runs in its own process: test_the_kernel_in_triton_interpreter_on_the_cpu")
    monkeypatch.delenv("MINISGL_FUSED_SAMPLING", raising=False)
    gumbel._kernel.cache_clear()
    yield request.param
    gumbel._kernel.cache_clear()


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(ids.cpu(), minlength=len(probs)).double()
    expected = probs.double() * len(ids)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_draws_follow_softmax_over_temperature(device, temperature):
    from minisgl.engine import gumbel

    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7])
    rows = ROWS[device]
    batch = logits.repeat(rows, 1).to(device, torch.bfloat16)
    ids = gumbel.sample(batch, torch.full((rows, 1), temperature, device=device), seed=12345)
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    probs = torch.softmax(batch[0].float().cpu() / temperature, dim=-1)
    assert chi_square(ids, probs) < CHI2_LIMIT[7]
    # The wrong temperature is rejected by the same test: it can fail.
    other = torch.softmax(batch[0].float().cpu() / (temperature / 2), dim=-1)
    assert chi_square(ids, other) > CHI2_LIMIT[7]


def test_rows_split_over_programs_and_masked_tokens(device):
    """A vocabulary wider than one program's share: each row's winner may sit in any split; -inf never wins."""
    from minisgl.engine import gumbel

    vocab, rows = 5000, ROWS[device] // 4
    assert gumbel.splits_for(1, vocab) == 5  # what a batch of one gets; forced below for every batch size
    logits = torch.full((rows, vocab), float("-inf"))
    hot = torch.tensor([3, 1500, 2600, 4999] + [1024 * i + 7 for i in range(4)])  # across splits and blocks
    logits[:, hot] = torch.linspace(0.0, 1.4, len(hot))
    logits = logits.to(device)
    ids = gumbel.sample(logits, torch.ones(rows, device=device), seed=7, splits=5)
    assert set(ids.tolist()) <= set(hot.tolist())
    probs = torch.softmax(logits[0, hot].cpu(), dim=-1)
    position = {int(t): i for i, t in enumerate(hot)}
    assert chi_square(torch.tensor([position[i] for i in ids.tolist()]), probs) < CHI2_LIMIT[7]
    # One row's draws: the same seed gives the same ids, another seed others.
    again = gumbel.sample(logits, torch.ones(rows, device=device), seed=7, splits=5)
    assert torch.equal(ids, again)
    assert not torch.equal(ids, gumbel.sample(logits, torch.ones(rows, device=device), seed=8, splits=5))


def test_per_row_temperatures(device):
    """Two halves of a batch with different temperatures each follow their own distribution."""
    from minisgl.engine import gumbel

    logits = torch.linspace(-2.0, 2.0, 16)
    rows = 2 * ROWS[device]
    temps = torch.tensor([0.5] * (rows // 2) + [3.0] * (rows // 2))
    ids = gumbel.sample(logits.repeat(rows, 1).to(device, torch.float16), temps.to(device), seed=99).cpu()
    for half, t in ((ids[: rows // 2], 0.5), (ids[rows // 2 :], 3.0)):
        assert chi_square(half, torch.softmax(logits / t, dim=-1)) < CHI2_LIMIT[15]


def test_sampler_uses_it_for_temperature_batches_on_cuda(monkeypatch):
    """Sampler on CUDA: a temperature-only bf16 batch goes through the kernel, with the distribution of the
    float32 path; seeded rows, top-p and logprobs take the float32 path."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        pytest.skip("needs a CUDA GPU and Triton")
    from minisgl.core import Req, SamplingParams
    from minisgl.engine import gumbel
    from minisgl.engine.sampler import Sampler, SamplingInfo

    monkeypatch.delenv("MINISGL_FUSED_SAMPLING", raising=False)
    gumbel._kernel.cache_clear()
    calls = []
    real = gumbel.sample
    monkeypatch.setattr(gumbel, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    vocab, rows = 8, 4000
    sampler = Sampler(vocab, torch.device("cuda"), seed=0)
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7], device="cuda")
    batch = logits.repeat(rows, 1).to(torch.bfloat16)

    def reqs(**params):
        return [Req(rid=f"r{i}", input_ids=[1], sampling_params=SamplingParams(**params), prompt_len=1,
                    eos_token_ids=frozenset()) for i in range(rows)]

    plain = reqs(temperature=0.7)
    ids, logprobs = sampler.sample(batch, plain, SamplingInfo.from_reqs(plain, vocab, torch.device("cuda")))
    assert calls and logprobs is None
    assert chi_square(ids, torch.softmax(batch[0].float().cpu() / 0.7, dim=-1)) < CHI2_LIMIT[7]
    calls.clear()
    with_logprobs = reqs(temperature=0.7, logprobs=2)
    ids, logprobs = sampler.sample(batch, with_logprobs, SamplingInfo.from_reqs(with_logprobs, vocab, torch.device("cuda")))
    assert not calls and len(logprobs) == rows
