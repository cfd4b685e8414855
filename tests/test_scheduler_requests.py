"""A request with n samples is one request: its id is in flight until its last sample ends, its usage counts the
prompt once (cached_tokens as the prefix cache held it when the request came)."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams


def test_a_request_id_stays_in_flight_until_its_last_sample_ends(tiny_model_dir):
    """n = 2 with max_tokens=1: sample 0 ends with the prompt's prefill, sample 1 (which reads the prompt from the
    cache) a step later. A new request with the same id in between was accepted and mixed with the old one's
    sample 1 (one abort ended both); it is an InvalidRequestError that changes nothing, and the id is free again once
    the last sample ends."""
    from minisgl.errors import InvalidRequestError

    llm = LLM(str(tiny_model_dir("llama")), disable_overlap=True)
    sched = llm.scheduler
    sched.add_request("x", [11, 12, 13], SamplingParams(temperature=0, max_tokens=1, n=2, ignore_eos=True))
    first = sched.step()
    assert [(o.index, o.finished) for o in first] == [(0, True)]
    with pytest.raises(InvalidRequestError, match="already in flight"):
        sched.add_request("x", [14, 15], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    rest = []
    while sched.has_work:
        rest += sched.step()
    assert [(o.index, o.finished, o.new_token_ids) for o in rest] == [(1, True, first[0].new_token_ids)]
    sched.add_request("x", [14, 15], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.check_integrity()


def test_usage_of_n_samples_counts_the_prompt_cached_before_the_request(tiny_model_dir):
    """Usage's cached_tokens is the part of the prompt the prefix cache held when the request came (vLLM's
    num_cached_tokens). Sample 1 reads the prompt that sample 0 computed and ends last: the daemon's usage took its
    39 for a 40-token prompt never seen before. A cold prompt: 0; the same prompt again: all but its last token."""
    from minisgl.runtime.detokenizer_worker import Detokenizer

    llm = LLM(str(tiny_model_dir("llama")), disable_overlap=True)
    sched, prompt = llm.scheduler, list(range(20, 60))
    detok = Detokenizer(llm.tokenizer)
    usages = []
    for rid in ("cold", "warm"):
        sched.add_request(rid, prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=4, n=2, ignore_eos=True))
        detok.add_request(rid, {"n": 2})
        chunks = []
        while sched.has_work:
            chunks += detok.process(sched.step())[0]
        assert [c.index for c in chunks if c.done] == [1]  # sample 1 ends last: its prefix hit is the prompt
        usages.append(next(c.usage for c in chunks if c.done))
    assert [(u.prompt_tokens, u.cached_tokens) for u in usages] == [(40, 0), (40, 39)]


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_token_out_of_range_past_a_cached_prefix_is_still_rejected(tiny_model_dir, bad):
    """add_request scans only the tokens past the prefix the cache holds (those were checked when first seen): a bad
    token right after a long cached prefix, or in its last page, is an InvalidRequestError that changes nothing."""
    from minisgl.errors import InvalidRequestError

    llm = LLM(str(tiny_model_dir("llama")), disable_overlap=True, page_size=4)
    sched = llm.scheduler
    vocab = sched.model_config.vocab_size
    bad = vocab if bad == "vocab" else bad
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert sched.cache.match_len(prompt) == 40
    for ids in (prompt + [bad], prompt + [bad, 5, 6], prompt[:37] + [bad], [bad] + prompt):
        with pytest.raises(InvalidRequestError, match="token ids must be in"):
            sched.add_request("bad", ids, SamplingParams(temperature=0, max_tokens=2))
        assert not sched.has_work
    sched.add_request("ok", prompt + [vocab - 1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while sched.has_work:
        sched.step()
    llm.check_integrity()
