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


# (arrival step, prompt length, starts with the shared 12-token system prompt, max_tokens): with a 9-page pool
# of 4-token pages and 4-token prefill chunks, two prompts are left partly prefilled, each waiting for pages
# the other holds, while nothing runs (no decode step rolls either back).
STALL_WORKLOAD = [
    (1, 15, True, 2),
    (2, 26, False, 10),
    (2, 23, False, 1),
    (3, 27, False, 2),
    (3, 13, False, 1),
    (7, 18, True, 18),
    (7, 30, False, 1),
    (12, 16, False, 2),
    (14, 12, False, 24),
    (15, 31, False, 2),
    (15, 21, True, 15),
    (16, 16, False, 2),
    (17, 34, False, 2),
]


def _drive(
    llm: LLM, arrivals: list[tuple[int, str, list[int], SamplingParams]], max_steps: int
) -> dict[str, list[int]]:
    """Add each request at its step and step the scheduler until it is idle; {rid: output ids} of those finished."""
    sched = llm.scheduler
    tokens: dict[str, list[int]] = {}
    finished: dict[str, list[int]] = {}
    for step in range(max_steps):
        for at, rid, prompt, params in arrivals:
            if at == step:
                sched.add_request(rid, prompt, params)
        if step > max(a[0] for a in arrivals) and not sched.has_work:
            break
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.rid] = tokens[out.rid]
    return finished


def test_prompts_left_partly_prefilled_with_nothing_running_still_all_finish(tiny_model_dir):
    """Partly prefilled prompts that wait for pages are rolled back only by a decode step that needs pages; with
    nothing running, two of them (or one, behind a request ranked first that cannot fit beside it) held the pool
    for good and every request waited forever. Each request fits the pool alone: all finish as with a big pool."""
    import random

    model_dir = str(tiny_model_dir("llama"))
    rng = random.Random(0)
    system = [rng.randrange(10, 1000) for _ in range(12)]
    arrivals = []
    for i, (at, length, shared, max_tokens) in enumerate(STALL_WORKLOAD):
        head = system if shared else []
        prompt = head + [rng.randrange(10, 1000) for _ in range(length - len(head))]
        arrivals.append((at, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    llm = LLM(model_dir, page_size=4, num_pages=9, max_prefill_tokens=4, max_running_requests=4, disable_overlap=True)
    got = _drive(llm, arrivals, max_steps=3000)
    assert sorted(got) == sorted(rid for _, rid, _, _ in arrivals), "requests never finished: the scheduler stalled"
    big = LLM(model_dir, disable_overlap=True)
    ref = big.generate([p for _, _, p, _ in arrivals], [sp for *_, sp in arrivals], use_tqdm=False)
    assert [got[rid] for _, rid, _, _ in arrivals] == [o.token_ids for o in ref]
    llm.check_integrity()
    assert llm.stats()["req_pages"] == 0


def _audit_pages(sched) -> None:
    """Every page is exactly one of free, in a radix node, or owned by a live request (its row past matched_len),
    read from the free list, the tree and the page table (not from the cache's counters); every node's lock count
    is the number of live requests whose handle lies at or below it."""
    from minisgl.kvcache.radix import RadixCache

    cache, ps = sched.cache, sched.page_size
    free = cache._free_pages.tolist()
    tree = cache.prefix_cache
    nodes = tree._nodes() if isinstance(tree, RadixCache) else []
    cached = [p for n in nodes for p in (n.value[::ps] // ps).tolist()]
    owned, locks = [], {}
    for req in sched.reqs.values():
        if req.table_idx < 0:
            continue
        row = sched.page_table[req.table_idx]
        assert set((row[: req.matched_len : ps] // ps).tolist()) <= set(cached), "a borrowed page is not cached"
        owned += (row[req.matched_len : req.cached_len : ps] // ps).tolist()
        node = req.cache_handle
        while node is not None and node is not tree.root:
            locks[id(node)] = locks.get(id(node), 0) + 1
            node = node.parent
    assert sorted(free + cached + owned) == list(range(cache.num_pages)), "a page is in two places or none"
    assert [n.ref_count for n in nodes] == [locks.get(id(n), 0) for n in nodes]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(page_size=1, num_pages=70, max_prefill_tokens=16, extra={"overlap_on_cpu": True}),
        dict(page_size=4, num_pages=20, max_prefill_tokens=17, max_running_requests=3, disable_overlap=True),
        dict(page_size=2, num_pages=40, max_prefill_tokens=8, cache="naive", extra={"overlap_on_cpu": True}),
    ],
)
def test_random_traffic_with_aborts_and_flushes_keeps_every_page_accounted(tiny_model_dir, engine_kwargs):
    """Requests arrive, share prefixes, run n > 1 samples and are aborted at every phase (waiting, mid chunked
    prefill, decoding, retracted, in flight) while a small pool forces roll-backs, retraction and eviction and the
    prefix cache is flushed now and then: after every step the pages add up (checked page by page), each sequence
    ends once, and the sequences not aborted equal a big pool's greedy outputs."""
    import random

    model_dir = str(tiny_model_dir("llama"))
    rng = random.Random(5)
    stems = [[rng.randrange(10, 1000) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    arrivals, aborts = [], {}
    for i in range(16):
        prompt = rng.choice(stems)[: rng.randrange(1, 30)] + [
            rng.randrange(10, 1000) for _ in range(rng.randrange(1, 20))
        ]
        params = SamplingParams(
            temperature=0, max_tokens=rng.choice([1, 4, 12, 20]), ignore_eos=True, n=rng.choice([1, 1, 2])
        )
        arrivals.append((rng.randrange(0, 30), f"r{i}", prompt, params))
        if rng.random() < 0.4:
            aborts[f"r{i}"] = arrivals[-1][0] + rng.randrange(0, 12)
    llm = LLM(model_dir, max_seq_len=128, **engine_kwargs)
    sched = llm.scheduler
    tokens: dict[tuple[str, int], list[int]] = {}
    ended: dict[tuple[str, int], str] = {}
    for step in range(3000):
        for at, rid, prompt, params in arrivals:
            if at == step:
                sched.add_request(rid, prompt, params)
        for rid, at in aborts.items():
            if at == step:
                sched.abort(rid)
        if rng.random() < 0.05:
            sched.reset_prefix_cache()
        if step > 50 and not sched.has_work:
            break
        for out in sched.step():
            key = (out.rid, out.index)
            assert key not in ended, f"{key} got an output after its last"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                ended[key] = out.finish_reason
        _audit_pages(sched)
    assert sorted(ended) == sorted((rid, i) for _, rid, _, p in arrivals for i in range(p.n))
    kept = [(rid, prompt, params) for _, rid, prompt, params in arrivals if rid not in aborts]
    ref = LLM(model_dir, disable_overlap=True).generate(
        [p for _, p, _ in kept], [sp for *_, sp in kept], use_tqdm=False
    )
    for (rid, _, params), want in zip(kept, ref):
        assert [tokens.get((rid, i), []) for i in range(params.n)] == [o.token_ids for o in want.outputs]
    assert sched.stats()["req_pages"] == 0
    llm.check_integrity()
