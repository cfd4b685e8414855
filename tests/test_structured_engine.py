"""Grammar-constrained generation through the engine (issue 4 acceptance, offline path)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from minisgl import LLM, SamplingParams, errors

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Bounded strings and numbers: the grammar alone guarantees a short, complete object.
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LLM("smollm2")


def test_smollm2_json_schema_output_validates_for_20_prompts_at_temperature_1(smollm2):
    topics = [
        "a pirate",
        "a chef",
        "an astronaut",
        "a child",
        "a teacher",
        "a painter",
        "a doctor",
        "a farmer",
        "a king",
        "a robot",
        "a cat owner",
        "a poet",
        "a pilot",
        "a nurse",
        "a wizard",
        "a sailor",
        "a student",
        "a judge",
        "a baker",
        "a runner",
    ]
    convs = [[{"role": "user", "content": f"Describe {t} as JSON with a name and an age."}] for t in topics]
    params = [SamplingParams(temperature=1.0, max_tokens=200, json_schema=PERSON, seed=i) for i in range(20)]
    outs = smollm2.chat(convs, params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    smollm2.check_integrity()


def test_smollm2_regex_constraint_always_matches(smollm2):
    prompts = [f"Q: When did event {i} happen? Answer with a date. A:" for i in range(6)]
    outs = smollm2.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, regex=DATE, seed=1), use_tqdm=False)
    for out in outs:
        assert re.fullmatch(DATE, out.text), out.text
    smollm2.check_integrity()


def test_tiny_random_model_json_schema_validates_for_50_sampled_requests(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen2")))
    params = [SamplingParams(temperature=1.0, max_tokens=64, json_schema=BOUNDED, seed=i) for i in range(50)]
    outs = llm.generate([[11 + i, 12, 13] for i in range(50)], params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), BOUNDED)
    llm.check_integrity()


def test_bad_constraints_are_rejected_before_scheduling(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")))
    with pytest.raises(errors.GrammarError):
        llm.generate([[1, 2, 3]], SamplingParams(json_schema={"type": "objekt"}), use_tqdm=False)
    with pytest.raises(errors.GrammarError):
        llm.generate([[1, 2, 3]], SamplingParams(regex="(unclosed"), use_tqdm=False)
    with pytest.raises(errors.GrammarError):
        llm.generate([[1, 2, 3]], SamplingParams(ebnf="root ::= undefined_rule"), use_tqdm=False)
    with pytest.raises(errors.GrammarError):
        SamplingParams(regex=DATE, json_schema=PERSON)
    with pytest.raises(errors.InvalidRequestError, match="grammar_after needs a grammar"):
        SamplingParams(grammar_after="</think>")
    with pytest.raises(errors.InvalidRequestError, match="grammar_after"):
        SamplingParams(regex=DATE, grammar_after="")
    assert not llm.scheduler.has_work
    llm.check_integrity()
