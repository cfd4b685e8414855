"""Hostile and careless input on the engine: one request never stalls or fails another, limits give typed errors."""

from __future__ import annotations

import re
import time

import pytest

from minisgl import LLM, SamplingParams, errors

HOSTILE_REGEX = "[^c]{1,3000}" * 60  # ~780 bytes of long bounded repeats: slow to compile
SHORT_TIMEOUT_S = 3.0
SLOW_COMPILE_S = 12.0  # a hostile regex's least compile time here, whatever the machine's speed


class SlowCompiler:
    """xgrammar's compiler, with every regex of long bounded repeats taking at least SLOW_COMPILE_S: how slow
    such a grammar compiles depends on the CPU (a minute on some, seconds on others), the tests must not."""

    def __init__(self, compiler) -> None:
        self.compiler = compiler

    def __getattr__(self, name: str):
        return getattr(self.compiler, name)

    def compile_regex(self, regex: str, *args, **kwargs):
        t0 = time.monotonic()
        result = self.compiler.compile_regex(regex, *args, **kwargs)
        if "{1,29" in regex or "{1,3000}" in regex:
            time.sleep(max(0.0, SLOW_COMPILE_S - (time.monotonic() - t0)))
        return result


NORMAL = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), grammar_compile_timeout=SHORT_TIMEOUT_S) as engine:
        backend = engine.scheduler.grammars.backend()
        backend._compiler = SlowCompiler(backend._compiler)
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


@pytest.mark.parametrize(
    "params, error, words",
    [
        (dict(n=17), errors.InvalidRequestError, "max_n=16"),
        (dict(stop=[f"s{i}" for i in range(17)]), errors.InvalidRequestError, "max_stop_strings=16"),
        (dict(stop=["x" * 1025]), errors.InvalidRequestError, "max_stop_string_len=1024"),
        (dict(n=2**70), errors.InvalidRequestError, "n=.* is too large"),
        (dict(stop_token_ids=[2**64]), errors.InvalidRequestError, "stop_token_ids"),
    ],
)
def test_a_request_past_a_limit_is_a_typed_error_offline(llm, params, error, words):
    with pytest.raises(error, match=words):
        llm.generate([[1, 2, 3]], SamplingParams(**params), use_tqdm=False)
    llm.check_integrity()


def test_the_limits_are_configurable(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), max_n=2, max_stop_strings=1) as small:
        with pytest.raises(errors.InvalidRequestError, match="max_n=2"):
            small.generate([[1, 2]], SamplingParams(n=3, max_tokens=2), use_tqdm=False)
        with pytest.raises(errors.InvalidRequestError, match="max_stop_strings=1"):
            small.generate([[1, 2]], SamplingParams(stop=["a", "b"], max_tokens=2), use_tqdm=False)
        assert len(small.generate([[1, 2]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)[0].outputs) == 2


@pytest.fixture(scope="module")
def preparer(tokenizer_dir):
    from transformers import AutoTokenizer

    from minisgl.config import EngineConfig
    from minisgl.runtime.tokenizer_worker import RequestPreparer

    info = {"context_length": 1 << 20, "model_type": "llama", "config": EngineConfig().to_dict()}
    return RequestPreparer(AutoTokenizer.from_pretrained(tokenizer_dir), info)


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(
    "fields, error, words",
    [
        (dict(tools=[tool(f"t{i}") for i in range(129)]), errors.InvalidRequestError, "max_tools=128"),
        (dict(tools=[tool("deep", deep_schema(400))]), errors.GrammarError, r"tools\[0\] nests deeper than 64"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(400)}}),
            errors.GrammarError,
            "json_schema nests deeper than 64",
        ),
        (dict(params={"n": 1000}), errors.InvalidRequestError, "max_n=16"),
        (dict(params={"top_k": 2**70}), errors.InvalidRequestError, "too large"),
    ],
)
def test_the_text_worker_refuses_a_request_past_a_limit_before_rendering_it(preparer, fields, error, words):
    from minisgl.runtime.protocol import Generate

    msg = Generate("r", messages=[{"role": "user", "content": "hi"}], **fields)
    t0 = time.monotonic()
    with pytest.raises(error, match=words):
        preparer.prepare(msg)
    assert time.monotonic() - t0 < 1.0


def test_the_text_worker_takes_as_many_tools_as_the_limit(preparer):
    from minisgl.runtime.protocol import Generate

    add = preparer.prepare(
        Generate("r", messages=[{"role": "user", "content": "hi"}], tools=[tool(f"t{i}") for i in range(128)])
    )
    assert add.detok["tool_parser"] is not None


def test_a_max_tokens_past_int64_stops_at_the_context_like_any_other_past_it():
    from minisgl.runtime.protocol import Generate, decode, encode

    params = SamplingParams(max_tokens=2**70)
    assert params.max_tokens == 2**63 - 1
    assert decode(encode(Generate("r", prompt="x", params=params.to_dict()))).params["max_tokens"] == 2**63 - 1
    assert params.for_prompt(10, 2048).max_tokens == 2**63 - 1  # stops at the context's end: finish "length"
