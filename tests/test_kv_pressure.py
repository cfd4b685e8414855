"""The scheduler under KV pressure (small pools: prefills rolled back, requests retracted) against independent
references: HF transformers for the numbers, a page-by-page model of the pool for the accounting."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams


def test_prompt_logprobs_of_a_prefill_rolled_back_under_kv_pressure_match_hf(tiny_model_dir, monkeypatch):
    """A partly prefilled prompt that gives its pages back computes its prompt again from the start: its prompt
    logprobs are each prompt token's once (they were appended again after the first chunks: 217 for 200 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from minisgl.scheduler.kv import ReqKV

    model_dir = str(tiny_model_dir("llama"))
    prompts = [[(17 * i + j) % 900 + 20 for j in range(200)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    rolled_back = []
    roll_back = ReqKV.roll_back
    monkeypatch.setattr(ReqKV, "roll_back", lambda self, req: (rolled_back.append(req.rid), roll_back(self, req)))
    llm = LLM(model_dir, num_pages=64, page_size=4, max_prefill_tokens=32)  # each request fits alone, not two
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert rolled_back, "the workload no longer rolls a prefill back: the test pins down nothing"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for t in range(1, len(prompt)):
            lp, alts = got[t]
            assert lp == pytest.approx(float(ref[t - 1, prompt[t]]), abs=1e-4)
            assert [a for a, _ in alts] == [int(ref[t - 1].argmax())]
    llm.check_integrity()
