"""N-gram speculative decoding: drafts against a brute-force matcher; outputs against HF and the engine without it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tests.test_llm import hf_greedy, make_prompts, trim_after_eos

from minisgl import LLM, SamplingParams
from minisgl.scheduler import ngram, speculative


def brute_draft(tokens: list[int], shared: list[tuple[list[int], int]], k: int) -> list[int]:
    """The longest context first (n = 4..1); the request's own most recent earlier occurrence, then the latest
    finished sequence whose output continues it."""
    for n in range(min(4, len(tokens)), 0, -1):
        ctx = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == ctx:
                return tokens[end : end + k]
        for seq, start in reversed(shared):
            for end in range(len(seq) - 1, max(start, n) - 1, -1):
                if seq[end - n : end] == ctx:
                    return seq[end : end + k]
    return []


def test_ngram_drafts_match_a_brute_force_matcher():
    rng = random.Random(0)
    shared_index = ngram.SharedNgrams()
    shared: list[tuple[list[int], int]] = []
    for trial in range(40):
        vocab = rng.choice([3, 6, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        own = ngram.NgramIndex(tokens)
        for _ in range(40):
            k = rng.randrange(1, 9)
            assert ngram.propose(own, shared_index, k)[0] == brute_draft(tokens, shared, k), (trial, tokens)
            tokens.append(rng.randrange(vocab))  # the index follows the list it was given
        if trial % 3 == 0:
            start = rng.randrange(len(tokens))
            shared_index.add(tokens, start)
            shared.append((list(tokens), start))
            shared_index.file_pending(budget=1 << 30)
    assert ngram.propose(ngram.NgramIndex([1, 2, 3]), None, 4) == ([], 0)  # nothing repeats: no draft


def test_a_long_sequence_is_indexed_over_several_budgeted_calls_to_the_same_drafts():
    rng = random.Random(1)
    for trial in range(20):
        tokens = [rng.randrange(rng.choice([4, 30])) for _ in range(rng.randrange(70, 400))]
        own = ngram.NgramIndex(tokens)
        filed = 0
        while not own.synced:
            budget = rng.randrange(0, 90)
            done = own.sync(budget)
            assert done <= budget or (own.synced and done <= ngram.BULK)  # a short backlog is filed whole
            filed += done
        assert filed == len(tokens) - 1  # every position with a continuation, once
        for _ in range(5):
            k = rng.randrange(1, 9)
            assert ngram.propose(own, None, k)[0] == brute_draft(tokens, [], k), (trial, tokens)
            tokens.append(rng.randrange(4))
            assert own.sync(0) == 1 and own.synced  # a new token is filed whatever the budget


def test_finished_sequences_are_filed_oldest_first_within_each_steps_budget():
    shared = ngram.SharedNgrams()
    key = ngram._context_key([7, 8])
    for continuation in ([1, 2], [3, 4], [5, 6]):  # three answers continue [7, 8] differently
        shared.add([7, 8, *continuation], start=2)
    shared.file_pending(budget=1)  # one sequence at least, even past the budget
    assert shared.continuation(key, 2) == [1, 2]
    shared.file_pending(budget=3)  # 2 tokens, still under budget: the next one too
    assert shared.continuation(key, 2) == [5, 6]  # the latest answer's continuation wins


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat their own phrases (drafts find matches) plus test_llm's mixed lengths and shared prefix."""
    rng = random.Random(1)
    phrase = [rng.randrange(10, vocab) for _ in range(6)]
    return [phrase * 4, phrase * 2 + [rng.randrange(10, vocab)] + phrase] + make_prompts(vocab)


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(page_size=1), dict(page_size=16, max_prefill_tokens=16), dict(cache="naive", page_size=4)],
    ids=["radix-p1", "radix-p16-chunked", "naive-p4"],
)
def test_greedy_with_speculation_equals_hf_and_leaks_no_page(llama, engine_kwargs):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(llama)).vocab_size
    prompts = repetitive_prompts(vocab)
    ref = hf_greedy(llama, prompts, 24)
    llm = LLM(str(llama), speculative="ngram", max_running_requests=2, **engine_kwargs)  # small batches speculate
    for _ in range(2):  # the second time the prompts and the first outputs are cached and shared
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        eos = set(llm.model_config.eos_token_ids)
        assert [o.token_ids for o in outs] == [trim_after_eos(r, eos) for r in ref]
        llm.check_integrity()
    stats = llm.scheduler.stats()
    assert stats["spec_drafted_tokens"] > 0


def test_tp2_with_speculation_equals_tp1_without(llama):
    """Tensor parallelism (gloo): every rank drafts the same tokens, a function of the requests' tokens and of the
    finished sequences, which all ranks share step by step, and verifies them in the same collective forward."""
    from transformers import AutoConfig

    prompts = repetitive_prompts(AutoConfig.from_pretrained(str(llama)).vocab_size)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(llama)).generate(prompts, params, use_tqdm=False)]
    with LLM(str(llama), tp=2, speculative="ngram", max_running_requests=2, dist_timeout=60) as llm:
        for _ in range(2):  # the second time the first outputs are drafts too
            assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        llm.check_integrity()
        assert llm.scheduler.stats()["spec_drafted_tokens"] > 0


class OracleDrafts:
    """Drafts from the reference outputs, wrong at every third token: accepted runs, rejections, all lengths."""

    def __init__(self, prompts: list[list[int]], ref: list[list[int]]) -> None:
        self.by_prompt = {tuple(p): r for p, r in zip(prompts, ref)}
        self.calls = 0

    def __call__(self, own, shared, k, min_n=1):
        tokens = own.tokens
        for plen in range(len(tokens), 0, -1):
            ref = self.by_prompt.get(tuple(tokens[:plen]))
            if ref is not None:
                break
        else:
            return [], 0
        self.calls += 1
        done = len(tokens) - plen
        draft = list(ref[done : done + k])
        if self.calls % 3 == 0 and draft:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 100
        return draft, 4


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "overlap"])
def test_forced_drafts_accept_and_reject_yet_outputs_equal_hf(llama, monkeypatch, overlap):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(llama)).vocab_size
    prompts = make_prompts(vocab)
    ref = hf_greedy(llama, prompts, 20)
    oracle = OracleDrafts(prompts, ref)
    monkeypatch.setattr("minisgl.scheduler.speculative.propose", oracle)
    llm = LLM(str(llama), speculative="ngram", page_size=4, extra={"overlap_on_cpu": overlap})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    llm.check_integrity()
    stats = llm.scheduler.stats()
    # Most drafts are right, every third has a wrong token in its middle.
    assert stats["spec_accepted_tokens"] >= 0.4 * sum(len(r) for r in ref)
    assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]


def test_under_overlap_a_step_that_cannot_draft_does_not_wait_for_its_tokens(llama, monkeypatch):
    """Overlap scheduling stays on for the steps of rows that repeat nothing: only a step that may speculate
    reads its previous tokens before it is scheduled."""
    from transformers import AutoConfig

    from minisgl.scheduler.scheduler import Scheduler

    in_flight_at_schedule: list[bool] = []
    schedule = Scheduler._schedule

    def spy(self):
        in_flight_at_schedule.append(self._inflight is not None)
        return schedule(self)

    monkeypatch.setattr(Scheduler, "_schedule", spy)
    monkeypatch.setattr("minisgl.scheduler.speculative.propose", lambda *args, **kwargs: ([], 0))
    vocab = AutoConfig.from_pretrained(str(llama)).vocab_size
    prompts = make_prompts(vocab)[:2]
    ref = hf_greedy(llama, prompts, 20)
    llm = LLM(str(llama), speculative="ngram", page_size=4, extra={"overlap_on_cpu": True})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.scheduler.overlap and sum(in_flight_at_schedule) >= 0.8 * len(in_flight_at_schedule)
    llm.check_integrity()


def test_a_replayed_acceptance_pattern_accepts_exactly_what_it_says(llama):
    """bench spec-replay's drafts: each recorded step drafts k tokens of the known output with token a made wrong;
    the verifier accepts exactly a of them and the output is the plain one."""
    from minisgl.bench.spec_replay import ReplayedDrafts

    prompt = list(range(5, 37))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = LLM(str(llama)).generate([prompt], params, use_tqdm=False)[0].token_ids
    steps = [[1, 4, 4], [6, 6, 2], [9, 3, 0], [12, 8, 5], [20, 2, 2]]  # each step starts where the last one ended
    on = LLM(str(llama), speculative="ngram")
    replay = ReplayedDrafts(reference, steps, on.model_config.vocab_size)
    on.scheduler.spec.drafts, on.scheduler.spec.may_draft = replay.drafts, replay.may_draft
    out = on.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == reference
    stats = on.scheduler.stats()
    assert (stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]) == (23, 13)
    on.check_integrity()


def test_a_replayed_lookup_leaves_each_draft_to_the_policy(llama, monkeypatch, always_draft):
    """bench spec-replay --policy: the recorded drafts stand in for the n-gram lookup. A policy that drafts whatever
    it finds verifies a step's draft from its recorded start, continues a run it joins late (output position 13 is
    inside the step at 12: its draft starts there), and drafts nothing where no step was recorded; the output is
    the plain one."""
    from minisgl.bench.spec_replay import ReplayedLookup

    prompt = list(range(5, 37))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = LLM(str(llama)).generate([prompt], params, use_tqdm=False)[0].token_ids
    lookup = ReplayedLookup(reference, [[1, 4, 4], [12, 8, 5]], 1000, len(prompt))
    assert lookup.propose(SimpleNamespace(tokens=prompt + reference[:13]), None, 8) == (
        reference[13:17] + [(reference[17] + 1) % 1000] + reference[18:20],
        4,
    )
    assert lookup.propose(SimpleNamespace(tokens=prompt + reference[:7]), None, 8) == ([], 0)
    assert lookup.propose(SimpleNamespace(tokens=prompt + reference[:17]), None, 8) == ([], 0)  # the miss: no run
    monkeypatch.setattr(speculative, "propose", lookup.propose)
    on = LLM(str(llama), speculative="ngram")
    assert on.generate([prompt], params, use_tqdm=False)[0].token_ids == reference
    stats = on.scheduler.stats()
    assert (stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]) == (12, 9)  # the recorded steps, whole
    on.check_integrity()


def test_a_verify_step_that_fails_frees_every_page_and_the_engine_goes_on(llama, monkeypatch):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(llama)).vocab_size
    prompts = make_prompts(vocab)[:3]
    ref = hf_greedy(llama, prompts, 12)
    monkeypatch.setattr("minisgl.scheduler.speculative.propose", OracleDrafts(prompts, ref))
    llm = LLM(str(llama), speculative="ngram", page_size=4)
    engine = llm.scheduler.engine
    real = engine.forward_and_verify
    calls = []

    def failing(batch, apply=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("verify kernel failed")
        return real(batch, apply)

    monkeypatch.setattr(engine, "forward_and_verify", failing)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with pytest.raises(Exception, match="verify kernel failed"):
        llm.generate(prompts, params, use_tqdm=False)
    llm.check_integrity()
    assert llm.scheduler.stats()["req_pages"] == 0 and not llm.scheduler.has_work
    outs = llm.generate(prompts, params, use_tqdm=False)  # the engine goes on, speculating, and is still exact
    assert [o.token_ids for o in outs] == ref and len(calls) > 2
    llm.check_integrity()


@pytest.fixture
def always_draft(monkeypatch):
    """Speculate whatever the expected gain: these tests check what verification emits, not when it pays."""
    monkeypatch.setitem(speculative.COST, "cpu", (0.0, 0.0))
    monkeypatch.setattr(speculative, "MARGIN", 0.0)


BIAS = {t: 100.0 for t in range(100, 106)}  # the mass on six tokens: drafts are often right and often wrong


def test_seeded_sampling_with_speculation_is_the_same_draw_as_without(llama, always_draft):
    """Verification draws each position's token as plain sampling does, and a seeded generator is rewound to the
    emitted tokens' draws: with a penalty, top-p and a bias, a seeded request gives the tokens it gives without."""
    bias = BIAS
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.3, logit_bias=bias, max_tokens=16, seed=s)
        for s in range(6)
    ]
    prompt = list(range(100, 106)) * 3
    off = LLM(str(llama), page_size=1).generate([prompt] * 6, params, use_tqdm=False)
    llm = LLM(str(llama), page_size=1, speculative="ngram", max_running_requests=1)
    on = llm.generate([prompt] * 6, params, use_tqdm=False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert llm.scheduler.stats()["spec_accepted_tokens"] > 0
    llm.check_integrity()


def test_sampled_tokens_with_speculation_have_the_plain_distribution(llama, always_draft):
    """Chi-square: the tokens of unseeded requests (temperature 1, top-p 0.9, a repetition penalty; a bias puts the
    mass on six tokens so the drafts are often right and often wrong) are distributed as without speculation."""
    from scipy.stats import chi2_contingency

    bias = BIAS
    params = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.3, logit_bias=bias, max_tokens=6)
    prompt = list(range(100, 106)) * 3
    counts = []
    for spec in (None, "ngram"):
        llm = LLM(str(llama), page_size=1, speculative=spec, max_running_requests=32, seed=1 if spec else 2)
        outs = llm.generate([prompt] * 240, params, use_tqdm=False)
        counts.append([o.token_ids[1:] for o in outs])  # the first token comes from the prefill: never verified
        if spec:
            stats = llm.scheduler.stats()
            assert stats["spec_accepted_tokens"] > 60 and stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"]
    for pos in range(4):
        seen = sorted({o[pos] for c in counts for o in c if len(o) > pos})
        table = [[sum(1 for o in c if len(o) > pos and o[pos] == t) for t in seen] for c in counts]
        keep = [j for j in range(len(seen)) if table[0][j] + table[1][j] >= 10]  # rare tokens pooled
        rest = [sum(row[j] for j in range(len(seen)) if j not in keep) for row in table]
        table = [[row[j] for j in keep] + ([r] if any(rest) else []) for row, r in zip(table, rest)]
        assert chi2_contingency(table)[1] > 0.001, (pos, table)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir):
    """SmolLM2 without speculation (the reference) and with it."""
    return LLM("smollm2"), LLM("smollm2", speculative="ngram")


def copy_with_edit() -> list[dict[str, str]]:
    from minisgl.bench.spec import workloads

    return workloads(1)["copy-with-edit"][0]


def test_smollm2_copy_with_edit_is_token_identical_and_mostly_drafted(smollm2_pair):
    off, on = smollm2_pair
    params = SamplingParams(temperature=0, max_tokens=96)
    ref = off.chat(copy_with_edit(), params, use_tqdm=False)
    before = on.scheduler.stats()["spec_accepted_tokens"]
    out = on.chat(copy_with_edit(), params, use_tqdm=False)
    assert out.token_ids == ref.token_ids and out.text == ref.text
    accepted = on.scheduler.stats()["spec_accepted_tokens"] - before
    assert accepted > len(ref.token_ids) // 2  # most tokens were drafts
    assert out.spec_accepted_tokens == accepted and ref.spec_accepted_tokens == 0  # the usage says so
    on.check_integrity()


def test_stops_max_tokens_logprobs_and_n_inside_accepted_runs_equal_no_speculation(smollm2_pair):
    off, on = smollm2_pair
    free = off.chat(copy_with_edit(), SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)
    # A stop string and a stop token from the middle of the copied code: inside an accepted run.
    stop_text = free.text[len(free.text) * 2 // 3 :].split()[0]
    stop_token = free.token_ids[50]
    cases = [
        SamplingParams(temperature=0, max_tokens=80, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=80, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=37),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, n=2),
    ]
    before = on.scheduler.stats()["spec_accepted_tokens"]
    conversations = [copy_with_edit()] * len(cases)  # one batch: each case a row of its own
    wants, gots = (llm.chat(conversations, cases, use_tqdm=False) for llm in (off, on))
    for params, want, got in zip(cases, wants, gots):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs], params
        assert [(o.text, o.finish_reason, o.matched_stop) for o in got.outputs] == [
            (o.text, o.finish_reason, o.matched_stop) for o in want.outputs
        ]
        if params.logprobs:
            (g,), (w,) = [[o.logprobs for o in r.outputs] for r in (got, want)]
            assert len(g) == len(got.token_ids)
            for (lp_g, alts_g), (lp_w, alts_w) in zip(g, w):
                assert lp_g == pytest.approx(lp_w, abs=1e-3)
                assert [t for t, _ in alts_g] == [t for t, _ in alts_w]
    assert on.scheduler.stats()["spec_accepted_tokens"] > before  # the batch verified drafts
    assert len(on.chat(copy_with_edit(), cases[2], use_tqdm=False).token_ids) == 37
    on.check_integrity()


def test_json_schema_output_with_speculation_equals_without(smollm2_pair):
    from minisgl.bench.spec import workloads

    off, on = smollm2_pair
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "email": {"type": "string"},
            "city": {"type": "string"},
        },
        "required": ["id", "name", "email", "city"],
    }
    params = SamplingParams(temperature=0, max_tokens=80, json_schema=schema)
    conv = workloads(1)["tool-call"][0]
    want = off.chat(conv, params, use_tqdm=False)
    before = on.scheduler.stats()["spec_accepted_tokens"]
    got = on.chat(conv, params, use_tqdm=False)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert on.scheduler.stats()["spec_accepted_tokens"] > before  # the grammar let drafts through
    on.check_integrity()


def test_prometheus_counts_the_daemons_drafted_and_accepted_tokens():
    from minisgl.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    for drafted, accepted in ((10, 7), (15, 9), (4, 1)):  # the last: a restarted daemon counts from zero
        metrics.set_daemon_stats({"spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted})
    text = metrics.render().decode()
    assert 'minisgl_spec_decode_num_draft_tokens_total{model_name="m"} 19.0' in text
    assert 'minisgl_spec_decode_num_accepted_tokens_total{model_name="m"} 10.0' in text


def test_drafting_follows_acceptance_and_stops_where_it_is_a_loss():
    from minisgl.core import Req

    spec = speculative.Speculator(kv=None, max_seq_len=4096, device_type="cpu")  # drafts() never touches the KV

    def req(tokens: list[int]) -> Req:
        return Req("r", list(tokens), SamplingParams(temperature=0, max_tokens=100), len(tokens))

    assert spec.drafts([req([1, 2, 3, 4, 5])]) is None  # nothing repeats: no draft
    copying = req(list(range(10, 30)) + list(range(10, 14)))
    (first,) = spec.drafts([copying])
    assert first and first == list(range(14, 14 + len(first)))  # the 4-token context's continuation
    for _ in range(6):  # every draft accepted: the drafts grow to the most that pays
        (draft,) = spec.drafts([copying])
        spec.settle(copying, len(draft), len(draft))
    assert len(spec.drafts([copying])[0]) == speculative.MAX_DRAFT
    wrong = req(list(range(40, 60)) + list(range(40, 44)))
    drafted_at = []
    for step in range(40):  # every draft rejected: drafting backs off, the request decodes plainly
        drafts = spec.drafts([wrong])
        if drafts is not None:
            drafted_at.append(step)
            spec.settle(wrong, len(drafts[0]), 0)
        wrong.input_ids.append(wrong.input_ids[-20])  # a token a step; the passage goes on, so a draft is found
        wrong.output_ids.append(wrong.input_ids[-1])
    assert len(drafted_at) <= 6 and sum(s >= 30 for s in drafted_at) <= 1, drafted_at
    assert spec.drafts([req(list(range(10, 30)) + list(range(10, 14))) for _ in range(64)]) is None  # compute-bound


def test_a_request_met_late_decodes_plainly_and_a_long_prompt_is_indexed_over_steps(monkeypatch):
    """A request that sampled its first tokens in a batch too large to draft is never drafted for, and its text is
    never indexed; a new request's long prompt is filed FILE_BUDGET tokens a step, and drafts once it is whole."""
    from minisgl.core import Req

    monkeypatch.setattr(speculative, "FILE_BUDGET", 100)
    spec = speculative.Speculator(kv=None, max_seq_len=4096, device_type="cpu")
    passage = list(range(1000, 1300))

    def copying(outputs: int) -> Req:  # a 300-token passage, copied: its output repeats the prompt
        r = Req("r", passage + passage[: 4 + outputs], SamplingParams(temperature=0, max_tokens=1000), 304)
        r.output_ids = r.input_ids[304:]
        return r

    late = copying(speculative.LATE + 1)
    for _ in range(10):
        assert not spec.may_draft([late]) and spec.drafts([late]) is None
    assert spec.states[late] is None  # nothing filed for it
    early = copying(speculative.LATE)
    steps = 0
    while (drafts := spec.drafts([early])) is None and steps < 10:
        steps += 1
        early.input_ids.append(early.input_ids[-300])
        early.output_ids.append(early.input_ids[-1])
    assert steps == 3  # 368 tokens: 100 filed in each of three steps, the rest and then the first draft in the 4th
    n = len(early.input_ids)
    assert drafts[0] == passage[n - 300 : n - 300 + len(drafts[0])] and drafts[0]


def test_under_overlap_a_request_drafts_again_after_its_backoff():
    """Under overlap scheduling a step asks for drafts only when may_draft() says a row may draft: the backoff after a
    wholly rejected draft is counted in the request's tokens, so it ends (counted in calls, it never did)."""
    from minisgl.core import Req

    spec = speculative.Speculator(kv=None, max_seq_len=4096, device_type="cpu")
    r = Req("r", list(range(10, 30)) + list(range(10, 14)), SamplingParams(temperature=0, max_tokens=100), 24)
    verified = []
    for step in range(12):
        if spec.may_draft([r]) and (drafts := spec.drafts([r])) is not None:
            spec.settle(r, len(drafts[0]), 0 if step == 0 else len(drafts[0]))  # the first draft wholly rejected
            verified.append(step)
        r.input_ids.append(r.input_ids[-20])  # the copy goes on
        r.output_ids.append(r.input_ids[-1])
    assert verified[0] == 0 and len(verified) > 1 and verified[1] <= 3, verified


def test_under_tp_the_other_ranks_take_rank_0s_drafts_and_refuse_ones_that_do_not_fit():
    """Rank 0 decides (lead), its decisions travel as TPOps (signed, in sequence) and a rank > 0 takes them without
    deciding (follow): a rank whose own tokens would draft otherwise still verifies rank 0's drafts."""
    from minisgl.core import Req
    from minisgl.distributed.channel import TPOps
    from minisgl.runtime.tp import RankZeroDecisions

    def req(tokens: list[int]) -> Req:
        return Req("r", list(tokens), SamplingParams(temperature=0, max_tokens=100), len(tokens))

    class Wire:  # rank 0's sends, packed and unpacked as the channel does; a spoke's next_ops() reads them
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send(self, kind: str, decision: object) -> None:
            self.sent.append(TPOps(len(self.sent), [[kind, decision]]).pack(b"k" * 32))

        def next_ops(self) -> list:
            return TPOps.unpack(b"k" * 32, self.sent.pop(0)).ops

    wire = Wire()
    lead = speculative.Speculator(kv=None, max_seq_len=4096, device_type="cpu")
    lead.lead = wire.send
    follower = speculative.Speculator(kv=None, max_seq_len=4096, device_type="cpu")
    follower.follow = RankZeroDecisions(wire, vocab_size=100)
    copying = [req(list(range(10, 30)) + list(range(10, 14)))]
    plain = [req([1, 2, 3, 4, 5])]  # drafts nothing of its own
    assert lead.may_draft(copying) and follower.may_draft(plain)
    drafts = lead.drafts(copying)
    assert drafts and follower.drafts(plain) == drafts
    assert lead.drafts(plain) is None and follower.drafts(copying) is None
    assert lead.drafts(copying * 64) is None and not wire.sent  # beyond max_rows every rank knows: nothing is sent
    for kind, decision, rows in [
        ("drafts", [[1, 2]], 2),  # one row's drafts for a step of two
        ("drafts", [[1, 100]], 1),  # a token outside the vocabulary
        ("drafts", [["1"]], 1),
        ("may_draft", 1, 1),
        ("may_draft", True, 1),  # a may_draft where the rank waits for drafts
    ]:
        wire.send(kind, decision)
        with pytest.raises(RuntimeError, match="rank 0"):
            follower.follow("drafts" if kind == "may_draft" and decision is True else kind, rows)


def test_best_draft_is_the_length_of_the_largest_expected_gain():
    """Against the definition: a k-token draft emits its accepted tokens (until the first miss), less its cost."""
    for rate in (0.0, 0.1, 0.5, 0.8, 0.95, 1.0):
        for cost in (0.0, 0.02, 0.1, 0.3):
            for available in (0, 1, 3, 8):
                gains = [sum(rate**i for i in range(1, k + 1)) - cost * k for k in range(available + 1)]
                k, gain = speculative.best_draft(rate, available, cost)
                want = max(range(available + 1), key=lambda j: (round(gains[j], 12), -j))
                assert (k, round(gain, 9)) == (want, round(gains[want], 9)), (rate, cost, available)
