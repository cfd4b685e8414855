"""The sampler's batched logit edits against a row-by-row reference written out plainly."""

from __future__ import annotations

import random

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.sampler import apply_penalties, mask_stops_before_min_tokens

VOCAB = 50


def _req(rng: random.Random, **params) -> Req:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
    req = Req(
        rid="r",
        input_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        prompt_len=len(prompt),
        eos_token_ids=frozenset({2, 7}),
    )
    out = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
    req.output_ids, req.input_ids = out, prompt + out
    return req


def test_min_tokens_mask_blocks_exactly_each_rows_stops():
    rng = random.Random(0)
    reqs = [
        _req(rng, min_tokens=10),  # blocks the model's EOS ids
        _req(rng, min_tokens=10, stop_token_ids=[5, 9, VOCAB + 3, -1]),  # + its own; out-of-vocab ids ignored
        _req(rng, min_tokens=10, ignore_eos=True, stop_token_ids=[11]),  # its own only
        _req(rng, min_tokens=0, stop_token_ids=[5]),  # min_tokens reached: nothing
        _req(rng, min_tokens=10, ignore_eos=True),  # nothing to block
        _req(rng, min_tokens=10, stop_token_ids=[13]),
    ]
    reqs[-1].grammar = object()  # a grammar decides instead
    reqs[0].tokens_in_flight = 3  # counts as sampled: still below min_tokens
    logits = torch.randn(len(reqs), VOCAB)
    expected = logits.clone()
    for row, cols in {0: [2, 7], 1: [2, 5, 7, 9], 2: [11]}.items():
        expected[row, cols] = float("-inf")
    assert torch.equal(mask_stops_before_min_tokens(logits.clone(), reqs), expected)


def test_min_tokens_mask_lifts_once_enough_tokens_are_sampled():
    req = _req(random.Random(1), min_tokens=4)
    req.output_ids, req.tokens_in_flight = [1, 1, 1], 0
    assert torch.isinf(mask_stops_before_min_tokens(torch.zeros(1, VOCAB), [req])[0, 2])
    req.tokens_in_flight = 1  # the fourth token is in flight: a stop may be sampled next
    assert not torch.isinf(mask_stops_before_min_tokens(torch.zeros(1, VOCAB), [req])).any()


def test_penalties_match_a_row_by_row_reference():
    rng = random.Random(2)
    reqs = [
        _req(rng, repetition_penalty=1.3),
        _req(rng, presence_penalty=0.5, frequency_penalty=0.25),
        _req(rng),
        _req(rng, repetition_penalty=0.8, frequency_penalty=-0.5),
    ]
    logits = torch.randn(len(reqs), VOCAB)
    expected = logits.clone()
    for i, r in enumerate(reqs):
        p = r.sampling_params
        for t in set(r.input_ids):  # HF: every token of prompt + output, once
            x = expected[i, t]
            expected[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(r.output_ids):  # OpenAI: output tokens, by count
            expected[i, t] -= p.frequency_penalty * r.output_ids.count(t) + p.presence_penalty
    torch.testing.assert_close(apply_penalties(logits, reqs), expected)


def test_model_dtype_logits_give_the_float32_paths_tokens():
    """bf16 logits (what a CUDA-graph decode returns): greedy ids are the float32 argmax's; every other batch is
    cast and takes the float32 path (on the CPU the seeded draw is then the one of the float32 logits)."""
    from minisgl.engine.sampler import Sampler, SamplingInfo

    vocab = 50
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, vocab, generator=g) * 3).to(torch.bfloat16)
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_p=0.9),
    ):
        reqs = [Req(f"r{i}", [1], params, 1) for i in range(6)]
        info = SamplingInfo.from_reqs(reqs, vocab, torch.device("cpu"))
        got, _ = Sampler(vocab, torch.device("cpu"), seed=3).sample(logits, reqs, info)
        want, _ = Sampler(vocab, torch.device("cpu"), seed=3).sample(logits.float(), reqs, info)
        assert torch.equal(got, want)
        if params.temperature == 0:
            assert torch.equal(got, logits.float().argmax(-1))


def _filter_row(p: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then top-p over the renormalised top-k survivors (the first token always stays), by a plain sort."""
    order = sorted(range(len(p)), key=lambda t: -float(p[t]))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(p[t]) for t in kept)
    out, cum = torch.zeros_like(p), 0.0
    for t in kept:
        if cum >= top_p * mass:
            break
        out[t] = p[t]
        cum += float(p[t])
    return out


def test_top_k_and_top_p_keep_a_plain_sorts_tokens_among_candidates_and_past_them():
    """The CPU looks at each row's CANDIDATES most likely tokens first and sorts whole rows only when a cut may lie
    past them: rows mixing top-k, top-p, both, and cuts beyond the candidates keep exactly the reference's tokens."""
    from minisgl.engine import sampler
    from minisgl.engine.sampler import SamplingInfo

    vocab = 3000
    g = torch.Generator().manual_seed(0)
    cases = [
        [(20, 1.0), (-1, 0.9), (50, 0.8), (1, 1.0)],  # every cut among the candidates
        [(-1, 0.9), (-1, 0.999999), (700, 1.0)],  # a flat row's top-p and a top-k past the candidates: whole rows
    ]
    for case, peaked in zip(cases, (True, False)):
        logits = torch.randn(len(case), vocab, generator=g) * (6.0 if peaked else 0.5)
        probs = torch.softmax(logits, dim=-1)
        reqs = [
            Req(f"r{i}", [1], SamplingParams(temperature=1.0, top_k=k, top_p=p), 1) for i, (k, p) in enumerate(case)
        ]
        info = SamplingInfo.from_reqs(reqs, vocab, torch.device("cpu"))
        assert (sampler._candidates(probs, info, info.top_k, probs.sum(-1)) is not None) == peaked
        got = sampler._filter_probs(probs, info)
        for row, (k, p) in enumerate(case):
            want = _filter_row(probs[row], k, p)
            assert torch.equal(got[row] > 0, want > 0), (case, row)
            assert torch.equal(got[row], want)
