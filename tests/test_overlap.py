"""Overlap scheduling (tokens read one step late) gives the same outputs as step-by-step scheduling.

The pipeline runs on CPU too when config.extra["overlap_on_cpu"] is set, so these tests pin down
the host-side bookkeeping (late finishes, dropped extra tokens, retraction, aborts, no page
leaks) without a GPU; tests/test_gpu.py repeats the comparison on CUDA.
"""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams

OVERLAP = {"extra": {"overlap_on_cpu": True}}


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(40)]
    params = []
    for i in range(40):
        kind = i % 5
        if kind == 0:  # stops on EOS when the model says so: finishes one step "late" under overlap
            params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30)))
        elif kind == 1:  # seeded sampling: the same stream with and without overlap
            params.append(SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=rng.randrange(1, 30)))
        elif kind == 2:  # needs the previous token on the host before sampling: forces a synced step
            params.append(SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=3, max_tokens=12))
        elif kind == 3:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, stop_token_ids=[rng.randrange(10, vocab)], max_tokens=20, n=2))
    return prompts, params


@pytest.mark.parametrize("engine_kwargs", [{}, dict(page_size=4, num_pages=150, max_prefill_tokens=48)])
def test_overlap_outputs_equal_step_by_step_outputs(tiny_model_dir, engine_kwargs):
    model_dir = str(tiny_model_dir("llama"))
    from transformers import AutoConfig

    prompts, params = _workload(AutoConfig.from_pretrained(model_dir).vocab_size)
    plain = LLM(model_dir, disable_overlap=True, **engine_kwargs)
    overlap = LLM(model_dir, **engine_kwargs, **OVERLAP)
    assert overlap.scheduler.overlap and not plain.scheduler.overlap
    # Random tiny models rarely sample EOS: stop some greedy requests on their own third token.
    first = plain.generate(prompts, params, use_tqdm=False)
    for i, (o, p) in enumerate(zip(first, params)):
        if i % 5 == 3 and len(o.token_ids) > 3:
            params[i] = SamplingParams(temperature=0, stop_token_ids=[o.token_ids[2]], max_tokens=p.max_tokens)
    ref = plain.generate(prompts, params, use_tqdm=False)
    assert sum(o.finish_reason == "stop" for o in ref) >= 4
    got = overlap.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    assert [o.completion_tokens for o in got] == [o.completion_tokens for o in ref]
    overlap.check_integrity()
    plain.check_integrity()
    # A second batch on the same engine starts with the last in-flight step still queued.
    again = overlap.generate(prompts[:5], params[:5], use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref[:5]]
    overlap.check_integrity()


def test_overlap_abort_while_in_flight_frees_pages(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen2")), **OVERLAP)
    sched = llm.scheduler
    sched.add_request("a", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    sched.add_request("b", list(range(40, 60)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = sched.step() + sched.step() + sched.step()
    sched.abort("a")
    while sched.has_work:
        outs += sched.step()
    final = {o.rid: o for o in outs if o.finished}
    assert final["a"].finish_reason == "abort" and final["b"].finish_reason == "length"
    assert final["b"].completion_tokens == 5
    llm.check_integrity()
    assert sched.stats()["req_pages"] == 0


def test_min_tokens_under_overlap_equals_step_by_step(tiny_model_dir):
    """min_tokens needs only the count of sampled tokens (in flight ones included), not their values."""
    model_dir = str(tiny_model_dir("llama"))
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    plain = LLM(model_dir, disable_overlap=True)
    overlap = LLM(model_dir, **OVERLAP)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    # Each request's stop token is its own second greedy token: without min_tokens it would stop at 2.
    params = [SamplingParams(temperature=0, stop_token_ids=[o.token_ids[1]], min_tokens=6, max_tokens=12) for o in free]
    ref = plain.generate(prompts, params, use_tqdm=False)
    got = overlap.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for o, p in zip(ref, params):
        assert len(o.token_ids) >= 6
        assert p.stop_token_ids[0] not in o.token_ids[:5]
    assert all(r.tokens_in_flight == 0 for r in overlap.scheduler.reqs.values())
    overlap.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_larger_than_the_pool_keeps_its_last_token_under_overlap(tiny_model_dir, page_size):
    """A 20-token prompt, 40 KV slots: the request runs until every slot holds KV, then ends ("length") with the
    token sampled from the last slot's logits, as a big pool's greedy run has it. Under overlap that token was in
    flight when the next step found no slot, and ending the request there dropped it."""
    model_dir = str(tiny_model_dir("llama"))
    prompt = list(range(20, 40))
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    big = LLM(model_dir, disable_overlap=True).generate([prompt], params, use_tqdm=False)[0]
    expected = big.token_ids[: 40 - len(prompt) + 1]
    for kwargs in ({"disable_overlap": True}, OVERLAP):
        llm = LLM(model_dir, num_pages=40 // page_size, page_size=page_size, **kwargs)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert (out.token_ids, out.finish_reason) == (expected, "length"), kwargs
        llm.check_integrity()
