"""Each API's request as SamplingParams: the defaults each API defines and OpenAI's (and vLLM's) option names.

The edge's translation; SamplingParams itself (minisgl.core) knows only the engine's fields and their rules.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Mapping

from minisgl.core import SamplingParams
from minisgl.errors import GrammarError, InvalidRequestError

# Each edge's API and the defaults that API defines, the only defaults an edge sets (sampling_params_for); a field
# not named takes SamplingParams' own default. max_tokens None: up to the end of the context window (the daemon
# resolves it: SamplingParams.for_prompt).
API_DEFAULTS: dict[str, dict[str, Any]] = {
    "minisgl": {},  # Client, LLM: SamplingParams() as it is (max_tokens 16, as vLLM's SamplingParams)
    "openai.chat": {"max_tokens": None},  # /v1/chat/completions, LangChain, LiteLLM: only the context limits it
    "openai.completions": {"max_tokens": 16},  # OpenAI's legacy /v1/completions: 16 tokens
    "openai.responses": {"max_tokens": None},  # /v1/responses: max_output_tokens unset is no limit
    "ollama": {"max_tokens": None},  # /api/chat, /api/generate: num_predict -1, no limit
    "sglang": {"max_tokens": 128},  # SGLang's /generate: max_new_tokens 128
    "shell": {"max_tokens": 512, "temperature": 0.7},  # `minisgl shell`: a chat UI's answers
    "cli.generate": {"max_tokens": 64, "temperature": 0.0},  # `minisgl generate`: one greedy answer
}

_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def sampling_params_for(api: str, given: Mapping[str, Any]) -> SamplingParams:
    """Validated params of a request to `api` (a key of API_DEFAULTS): the fields given, over that API's own
    defaults, over SamplingParams' defaults. The one place an edge's request becomes SamplingParams."""
    return SamplingParams.from_dict({**API_DEFAULTS[api], **given})


def sampling_params_from_openai(request: Mapping[str, Any], api: str = "openai.chat") -> SamplingParams:
    """SamplingParams of an OpenAI-style request (chat or text completion, plus vLLM/SGLang extras).

    Keys that are not sampling parameters (model, messages, tools, ...) are ignored; None means
    "not given". max_completion_tokens wins over max_tokens; without either key, max_tokens is the API's
    default (API_DEFAULTS: none for chat, so the answer may run to the end of the context window, which
    the daemon resolves; 16 for legacy completions); a key given as None also means no limit (vLLM's null).
    logprobs: True/False (chat, with top_logprobs alternatives) or a number of alternatives (text completions).
    """
    given = {k: v for k, v in request.items() if v is not None}
    d = {k: v for k, v in given.items() if k in _FIELD_NAMES}
    d.pop("max_tokens", None)
    if "max_completion_tokens" in request or "max_tokens" in request:
        d["max_tokens"] = given.get("max_completion_tokens", given.get("max_tokens"))
    if isinstance(d.get("stop"), str):
        d["stop"] = [d["stop"]]
    d.update(_guided_grammar(given))
    logprobs = given.get("logprobs")
    if isinstance(logprobs, bool) or "top_logprobs" in given:
        if "top_logprobs" in given and not logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        d["logprobs"] = int(given.get("top_logprobs") or 0) if logprobs else None
    return sampling_params_for(api, d)


def _guided_grammar(given: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's structured-output extras as our grammar fields: guided_json / guided_regex / guided_choice /
    guided_grammar, and the newer structured_outputs={"json" | "regex" | "choice" | "grammar": ...}. A choice
    becomes an EBNF alternation of the literal strings. At most one grammar in all (SamplingParams checks)."""
    found: list[tuple[str, Any]] = []
    nested = given.get("structured_outputs")
    if nested is not None and not isinstance(nested, Mapping):
        raise InvalidRequestError("structured_outputs must be an object like {'json': {...}} or {'choice': [...]}")
    unknown = sorted(set(nested or {}) - {"json", "regex", "grammar", "choice", "json_object"})
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs: {unknown} not supported; give one of json, regex, grammar, choice, json_object"
        )
    if (nested or {}).get("json_object") is not None:
        if nested["json_object"] is not True:
            raise InvalidRequestError("structured_outputs.json_object must be true (any JSON object)")
        found.append(("json_schema", {"type": "object"}))  # OpenAI's JSON mode, as response_format json_object
    for source, prefix in ((given, "guided_"), (nested or {}, "")):
        for kind, field_name in (("json", "json_schema"), ("regex", "regex"), ("grammar", "ebnf"), ("choice", "ebnf")):
            value = source.get(prefix + kind)
            if value is None:
                continue
            if kind == "choice":
                if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                    raise InvalidRequestError(
                        f"{prefix or 'structured_outputs.'}choice must be a list of non-empty strings"
                    )
                value = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            found.append((field_name, value))
    if len(found) > 1 or (found and any(given.get(f) is not None for f in ("json_schema", "regex", "ebnf"))):
        raise GrammarError("give at most one of json_schema, regex, ebnf and vLLM's guided_* / structured_outputs")
    return dict(found)
