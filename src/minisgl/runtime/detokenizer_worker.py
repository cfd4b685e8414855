"""The text worker's output side: token ids -> text deltas (UTF-8 safe, stop strings trimmed), usage,
reasoning apart from the answer, tool calls, and the "tool_calls" finish reason (the one place it is decided)."""

from __future__ import annotations

from typing import Any

from minisgl.core import TokenOutput
from minisgl.runtime.protocol import Chunk, Error, Usage
from minisgl.tokenizer import IncrementalDetokenizer, shown_ids

# Why a grammar-constrained output that ran out of max_tokens is cut off, and what helps.
GRAMMAR_CUT_OFF = (
    "max_tokens was reached inside the {grammar} constraint, so the output is cut off and will not parse: raise "
    "max_tokens, or give a smaller, bounded schema (small models such as the 135M default need bounds: "
    "'maximum' on integers, 'maxLength' on strings, 'maxItems' on arrays, few fields)"
)

# The logprob of a token a grammar masked out is -inf, which JSON cannot carry: it reads as vLLM's floor.
MIN_LOGPROB = -9999.0


class RequestState:
    """One request's decoding state: a detokenizer (and tool parser) per sample index."""

    def __init__(self, tokenizer: Any, meta: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.n = int(meta.get("n", 1))
        self.stop = list(meta.get("stop") or [])
        self.min_tokens = int(meta.get("min_tokens") or 0)
        self.skip_special_tokens = bool(meta.get("skip_special_tokens", True))
        self.tool_parser_name = meta.get("tool_parser")  # set when the request has tools
        self.max_tool_calls: int | None = meta.get("max_tool_calls")  # 1 with parallel_tool_calls=false
        self.grammar: str | None = meta.get("grammar")  # "json_schema" / "regex" / "ebnf" when constrained
        self.reasoning = meta.get(
            "reasoning"
        )  # None: no reasoning parser; else whether the output opens inside <think>
        self.reasoning_parsers: dict[int, Any] = {}
        self.prompt_ids: list[int] | None = meta.get("prompt_ids")
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.tool_parsers: dict[int, Any] = {}
        self.called: set[int] = set()  # indices that produced a tool call
        self.finished: set[int] = set()
        self.completion_tokens = 0
        self.spec_accepted_tokens = 0  # the finished samples' accepted draft tokens
        self.cached_tokens = 0  # sample 0's prefix hit: the later samples read the prompt sample 0 computed

    def detok(self, index: int) -> IncrementalDetokenizer:
        if index not in self.detoks:
            self.detoks[index] = IncrementalDetokenizer(
                self.tokenizer, self.stop, self.skip_special_tokens, self.min_tokens
            )
        return self.detoks[index]

    def reasoning_parser(self, index: int) -> Any:
        if self.reasoning is None:
            return None
        if index not in self.reasoning_parsers:
            from minisgl.structured.reasoning import ReasoningParser  # lazy: structured/ loads xgrammar and torch

            self.reasoning_parsers[index] = ReasoningParser(bool(self.reasoning))
        return self.reasoning_parsers[index]

    def tool_parser(self, index: int) -> Any:
        if not self.tool_parser_name:
            return None
        if index not in self.tool_parsers:
            from minisgl.structured.parsers import get_tool_parser  # lazy: structured/ loads xgrammar and torch

            self.tool_parsers[index] = get_tool_parser(self.tool_parser_name)()
        return self.tool_parsers[index]


class Detokenizer:
    """Turns the scheduler's TokenOutputs into client Chunks (and Errors for failed requests)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, rid: str, meta: dict[str, Any]) -> None:
        self.states[rid] = RequestState(self.tokenizer, meta)

    def process(self, outputs: list[TokenOutput]) -> tuple[list[Chunk], list[Error]]:
        chunks, errors = [], []
        for out in outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue  # already failed (a sibling sequence's error ended the request)
            if out.error is not None and out.finish_reason == "abort":
                del self.states[out.rid]
                errors.append(Error(out.rid, out.error_type or "RequestAbortedError", out.error))
                continue
            chunks.append(self._chunk(state, out))
        return chunks, errors

    def _chunk(self, state: RequestState, out: TokenOutput) -> Chunk:
        detok = state.detok(out.index)
        ids = shown_ids(out.new_token_ids, out.finish_reason, out.matched_stop)  # finish_reason: None until the end
        text = detok.add(ids) if ids else ""
        if out.finished:
            text += detok.finish()
        reasoning = ""
        thinking = state.reasoning_parser(out.index)
        if thinking is not None:  # the answer (what follows </think>) goes on to the tool parser
            reasoning, text = thinking.feed(text)
            if out.finished:
                more_reasoning, more_text = thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        tool_calls = None
        parser = state.tool_parser(out.index)
        if parser is not None:
            from minisgl.structured.parsers import split_deltas  # lazy: structured/ loads xgrammar and torch

            text, tool_calls = split_deltas(parser.feed(text) + (parser.finish() if out.finished else []))
            if tool_calls and state.max_tool_calls is not None:  # the calls after the allowed ones are dropped
                tool_calls = [c for c in tool_calls if c["index"] < state.max_tool_calls] or None
            if tool_calls:
                state.called.add(out.index)
        finish_reason = out.finish_reason if out.finished else None
        if finish_reason == "stop" and out.index in state.called:
            finish_reason = "tool_calls"
        finish_detail = None
        if finish_reason == "length" and state.grammar is not None:
            finish_detail = GRAMMAR_CUT_OFF.format(grammar=state.grammar.replace("_", " "))
        usage, done = None, False
        if out.index == 0:
            state.cached_tokens = out.cached_tokens
        if out.finished:
            state.finished.add(out.index)
            state.completion_tokens += out.completion_tokens
            state.spec_accepted_tokens += out.spec_accepted_tokens
            if len(state.finished) == state.n:
                done = True
                usage = Usage(
                    out.prompt_tokens, state.completion_tokens, state.cached_tokens, state.spec_accepted_tokens
                )
                del self.states[out.rid]
        logprobs = self._logprobs(out.new_token_ids, out.new_logprobs) if out.new_logprobs else None
        prompt_logprobs = None
        if out.prompt_logprobs is not None and state.prompt_ids is not None:
            first = {
                "token_id": state.prompt_ids[0],
                "token": self._token(state.prompt_ids[0]),
                "logprob": None,
                "top_logprobs": [],
            }
            prompt_logprobs = [first, *self._logprobs(state.prompt_ids[1:], out.prompt_logprobs[1:])]
        if out.embedding is not None:  # an embedding request: the vector is the answer, not its one sampled token
            usage = usage._replace(completion_tokens=0) if usage is not None else None
            return Chunk(out.rid, out.index, "", [], None, "stop", None, None, usage, done, embedding=out.embedding)
        return Chunk(
            out.rid,
            out.index,
            text,
            list(out.new_token_ids),
            logprobs,
            finish_reason,
            out.matched_stop if out.finished else None,
            tool_calls,
            usage,
            done,
            reasoning,
            prompt_logprobs,
            finish_detail=finish_detail,
        )

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, token_ids: list[int], logprobs: list[Any]) -> list[dict[str, Any]]:
        entries = []
        for token_id, lp in zip(token_ids, logprobs):
            if lp is None:
                continue
            chosen, alts = lp
            entries.append(
                {
                    "token_id": token_id,
                    "token": self._token(token_id),
                    "logprob": max(float(chosen), MIN_LOGPROB),
                    "top_logprobs": [
                        {"token_id": int(t), "token": self._token(int(t)), "logprob": max(float(v), MIN_LOGPROB)}
                        for t, v in alts
                    ],
                }
            )
        return entries
