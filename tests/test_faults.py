"""Hostile and careless input on the engine: one request never stalls or fails another, limits give typed errors."""

from __future__ import annotations

import re
import time

import pytest

from minisgl import LLM, SamplingParams, errors

HOSTILE_REGEX = "[^c]{1,3000}" * 20  # ~260 bytes that take xgrammar about a minute to compile
SHORT_TIMEOUT_S = 6.0  # well under the hostile regex's compile time
NORMAL = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), grammar_compile_timeout=SHORT_TIMEOUT_S) as engine:
        yield engine


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def run_daemon_style(sched, until: set[str], timeout: float = 60) -> dict[str, tuple[float, list]]:
    """Step a scheduler as the daemon's loop does; (finish time, outputs) of each request id in `until`."""
    t0, done, outs = time.monotonic(), {}, {}
    while set(done) != until:
        assert time.monotonic() - t0 < timeout, f"still waiting for {until - set(done)}"
        if not sched.has_work:
            time.sleep(0.005)
            continue
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
            if out.finished:
                done[out.rid] = time.monotonic() - t0
    return {rid: (done[rid], outs[rid]) for rid in until}


def test_a_grammar_that_compiles_for_a_minute_fails_alone_while_others_decode(llm):
    alone = llm.generate([[4, 5, 6]], NORMAL, use_tqdm=False)[0].token_ids
    sched = llm.scheduler
    sched.grammars.backend()  # built once per engine, on the first constrained request
    sched.defer_grammars = True
    try:
        t0 = time.monotonic()
        sched.add_request("hostile", [1, 2, 3], SamplingParams(regex=HOSTILE_REGEX, max_tokens=4))
        assert time.monotonic() - t0 < 1.0 and "hostile" in sched.grammar_waiting  # queued, not compiled
        sched.add_request("normal", [4, 5, 6], NORMAL)
        got = run_daemon_style(sched, {"hostile", "normal"})
    finally:
        sched.defer_grammars = False
    normal_at, normal = got["normal"]
    hostile_at, hostile = got["hostile"]
    assert [t for o in normal for t in o.new_token_ids] == alone and normal[-1].error is None
    assert normal_at < SHORT_TIMEOUT_S and hostile_at >= SHORT_TIMEOUT_S  # it did not wait for the compile
    assert hostile[-1].error_type == "GrammarError" and "grammar_compile_timeout" in hostile[-1].error
    assert not sched.grammar_waiting
    llm.check_integrity()


def test_a_request_waiting_for_its_grammar_is_queued_once_it_compiles(llm):
    sched = llm.scheduler
    sched.defer_grammars = True
    try:
        sched.add_request("digits", [7, 8, 9], SamplingParams(regex="[0-9]{3,40}x", max_tokens=50, seed=1))
        sched.add_request("normal", [4, 5, 6], NORMAL)
        got = run_daemon_style(sched, {"digits", "normal"})
    finally:
        sched.defer_grammars = False
    text = llm.tokenizer.decode([t for o in got["digits"][1] for t in o.new_token_ids], skip_special_tokens=True)
    assert got["digits"][1][-1].error is None and re.fullmatch("[0-9]{3,40}x", text), text
    llm.check_integrity()


def test_an_aborted_request_leaves_the_grammar_queue(llm):
    sched = llm.scheduler
    sched.defer_grammars = True
    try:
        sched.add_request("gone", [1, 2, 3], SamplingParams(regex="[^d]{1,2999}" * 20, max_tokens=4))
        sched.abort("gone")
        outs = sched.step()
    finally:
        sched.defer_grammars = False
    assert not sched.grammar_waiting and [o.finish_reason for o in outs] == ["abort"]
    llm.check_integrity()


def test_offline_a_grammar_past_the_compile_timeout_is_a_grammar_error(llm):
    t0 = time.monotonic()
    with pytest.raises(errors.GrammarError, match="grammar_compile_timeout"):
        llm.generate([[1, 2, 3]], SamplingParams(regex="[^e]{1,2998}" * 20), use_tqdm=False)
    assert time.monotonic() - t0 < SHORT_TIMEOUT_S + 10
    llm.check_integrity()


@pytest.mark.parametrize(
    "params, words",
    [
        (dict(regex="a" * 70_000), "larger than 65536 bytes"),
        (dict(json_schema={"type": "string", "pattern": "x" * 70_000}), "larger than 65536 bytes"),
        (dict(json_schema='{"type": "array", "items": ' * 400 + "{}" + "}" * 400), "deeper than 64 levels"),
        (dict(json_schema={"enum": [nested(5000)]}), "deeper than 64 levels"),
    ],
)
def test_a_grammar_over_the_size_limits_is_a_typed_error(llm, params, words):
    with pytest.raises(errors.GrammarError, match=words):
        llm.generate([[1, 2, 3]], SamplingParams(**params), use_tqdm=False)
