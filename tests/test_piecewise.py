"""Piecewise prefill (engine/piecewise.py): the model split at attention, padded to a captured size, hand-offs in
static buffers. On the CPU the pieces run eagerly (use_graphs=False): the same splitting, padding and buffers as the
CUDA graphs replay, judged against HF transformers. tests/test_gpu.py replays the real graphs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.engine.piecewise import PiecewiseGraphRunner, piecewise_sizes, supports_piecewise
from minisgl.errors import ConfigError

LONG = [(7 * i + 3) % 500 + 10 for i in range(45)]
SHORT = [(11 * i + 5) % 400 + 20 for i in range(23)]


def test_sizes_cover_every_token_count_up_to_the_maximum():
    assert piecewise_sizes(4096) == [16, 32, 64, 128, 256] + list(range(512, 4097, 512))
    assert piecewise_sizes(40) == [16, 32, 40]
    assert piecewise_sizes(10) == [10]
    assert piecewise_sizes(1000) == [16, 32, 64, 128, 256, 512, 1000]
    for top in (10, 40, 1000, 4096):
        sizes = piecewise_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top


def test_a_negative_token_limit_is_refused():
    with pytest.raises(ConfigError, match="piecewise_cuda_graph_max_tokens"):
        EngineConfig(piecewise_cuda_graph_max_tokens=-1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_piecewise_prefill_gives_hf_transformers_logprobs_and_tokens(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = {tuple(p): torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in (LONG, SHORT)}
        want_tokens = [
            hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            for p in (LONG, SHORT, LONG + [42])
        ]
    with LLM(str(model_dir), max_prefill_tokens=40, device="cpu") as llm:
        engine = llm.scheduler.engine
        assert engine.prefill_graphs is None  # on the CPU: eager unless a runner is put in
        assert supports_piecewise(engine.model)
        runner = PiecewiseGraphRunner(engine.model, 40, dummy_slot=0, device=engine.device, use_graphs=False)
        assert runner.sizes == [16, 32, 40] and not runner.fused_store
        engine.prefill_graphs = runner
        padded: list[tuple[int, int]] = []
        run = runner.run

        def spy(batch):
            tokens = batch.input_ids.shape[0]
            padded.append((tokens, runner.padded_size(tokens)))
            return run(batch)

        runner.run = spy
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        # One at a time, the long prompt first: the short one's padded rows hold the long one's stale values.
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in (LONG, SHORT)]
        for prompt, out in zip((LONG, SHORT), outs):
            got = torch.tensor([e[0] for e in out.prompt_logprobs[1:]])
            want = torch.stack([ref[tuple(prompt)][i - 1, prompt[i]] for i in range(1, len(prompt))])
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        cached = llm.generate(
            [LONG + [42]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        assert [o.token_ids for o in outs] + [cached.token_ids] == want_tokens
        assert cached.cached_tokens > 0
        # 45 tokens in chunks of 40 and 5, 23 tokens, then the cached rerun's new token: padded to 40, 16, 32, 16
        assert padded == [(40, 40), (5, 16), (23, 32), (1, 16)]
        llm.scheduler.check_integrity()
