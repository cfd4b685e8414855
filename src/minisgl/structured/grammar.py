"""Grammar-constrained decoding on top of xgrammar: compile (cached), match per request, mask per step.

One GrammarBackend per model (it owns the tokenizer's xgrammar view and the compile cache); one
GrammarState per constrained request (req.grammar); per decode step the scheduler calls
allocate_bitmask once, then fill_bitmask -> apply_bitmask -> GrammarState.accept_token.

JSON mode: OpenAI's response_format {"type": "json_object"} is SamplingParams(json_schema=
JSON_OBJECT_SCHEMA): any JSON object. It travels as a plain schema (msgpack-friendly, no marker)
and compiles once, like every other constraint.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
import xgrammar as xgr

from minisgl.errors import GrammarError
from minisgl.structured.schema import check_json_schema

if TYPE_CHECKING:
    from minisgl.core import SamplingParams

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

# A compile cache key: (kind, canonical text), kind in {"json", "regex", "ebnf"}.
GrammarKey = tuple[str, str]

MAX_GRAMMAR_BYTES = 64 * 1024  # a constraint's text (a schema as compact JSON, a regex, an EBNF grammar)
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (objects and arrays), as SGLang's and OpenAI's limits
COMPILE_TIMEOUT_S = 30.0  # a constraint that takes longer to compile fails its request alone

# xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:123: " and "Check failed: (...) is false: ".
_CPP_NOISE = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s+\S+?:\d+:\s*|Check failed: \(.*?\) is false:\s*")


def _clean_error(exc: BaseException) -> str:
    return _CPP_NOISE.sub("", str(exc)).strip() or type(exc).__name__


def json_depth(value: Any) -> int:
    """How deeply value's lists and dicts nest (a scalar is 0); iterative, so any depth is measured."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema_shape(schema: Any, what: str = "json_schema", max_depth: int = MAX_SCHEMA_DEPTH) -> None:
    """GrammarError for a schema nested deeper than max_depth (checked before anything recursive sees it)."""
    if json_depth(schema) > max_depth:
        raise GrammarError(f"{what} nests deeper than {max_depth} levels: flatten it (the limit is max_schema_depth)")


def grammar_key(
    params: "SamplingParams", max_bytes: int = MAX_GRAMMAR_BYTES, max_depth: int = MAX_SCHEMA_DEPTH
) -> GrammarKey | None:
    """The cache key of a request's constraint, or None when it has none; GrammarError over the size limits.

    A JSON schema is canonicalised (parsed, re-dumped compactly) so a dict and its JSON text share
    one entry; key order is kept because xgrammar emits properties in schema order.
    """
    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            _check_size("json_schema", schema, max_bytes)
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as e:
                raise GrammarError(f"json_schema is not valid JSON ({e}); pass a JSON object or a dict") from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        check_schema_shape(schema, max_depth=max_depth)
        key = ("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    elif params.regex is not None:
        if not isinstance(params.regex, str) or not params.regex:
            raise GrammarError("regex must be a non-empty string")
        key = ("regex", params.regex)
    elif params.ebnf is not None:
        if not isinstance(params.ebnf, str) or not params.ebnf.strip():
            raise GrammarError("ebnf must be a non-empty grammar string with a 'root' rule")
        key = ("ebnf", params.ebnf)
    else:
        return None
    _check_size({"json": "json_schema"}.get(key[0], key[0]), key[1], max_bytes)
    return key


def _check_size(what: str, text: str, max_bytes: int) -> None:
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise GrammarError(f"{what} is larger than {max_bytes} bytes: simplify it (the limit is max_grammar_bytes)")


def compile_timeout_error(timeout: float) -> GrammarError:
    return GrammarError(
        f"the grammar did not compile within {timeout:g}s (grammar_compile_timeout): simplify it; long bounded "
        "repetitions such as [^c]{1,3000} are what make a regex or schema expensive"
    )


class GrammarBackend:
    """Compiles constraints for one tokenizer/vocabulary and caches the results.

    vocab_size is the width of the model's logits (it may exceed len(tokenizer); the extra ids are
    never allowed by a grammar). stop_token_ids are the tokens that end a constrained request once
    its grammar is complete (default: the tokenizer's eos); a GrammarState can override them.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = None,
        compile_threads: int = 2,
        cache_size: int = 1024,
        max_bytes: int = MAX_GRAMMAR_BYTES,
        max_depth: int = MAX_SCHEMA_DEPTH,
        compile_timeout: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.vocab_size = int(vocab_size)
        stops = list(stop_token_ids) if stop_token_ids else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=stops
        )
        self.stop_token_ids: list[int] = list(self.tokenizer_info.stop_token_ids)
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads)
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.max_bytes, self.max_depth, self.compile_timeout = max_bytes, max_depth, compile_timeout
        # xgrammar compiles without the GIL; a few threads so that one slow grammar does not hold up the others
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="minisgl-grammar")
        self._bitmask: torch.Tensor | None = None  # apply()'s reusable buffer

    # ---- compile ---------------------------------------------------------------------------

    def compile_async(self, params: "SamplingParams") -> Future:
        """Start compiling params' constraint on the backend's thread; the future yields the
        CompiledGrammar (None when unconstrained) or raises GrammarError. Concurrent and repeated
        requests for one constraint share one future."""
        try:
            key = grammar_key(params, self.max_bytes, self.max_depth)
        except GrammarError as e:
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        if key is None:
            done: Future = Future()
            done.set_result(None)
            return done
        return self._future(key)

    def compile(self, params: "SamplingParams") -> xgr.CompiledGrammar | None:
        """The compiled constraint of params (None when it has none); GrammarError if invalid or if it takes
        longer than compile_timeout (the compile goes on, and its result stays cached)."""
        try:
            return self.compile_async(params).result(timeout=self.compile_timeout)
        except FutureTimeoutError:
            raise compile_timeout_error(self.compile_timeout) from None

    def validate(self, params: "SamplingParams") -> None:
        """Raise GrammarError if params' constraint does not compile; the result stays cached so
        the scheduler's later compile of the same constraint is free."""
        self.compile(params)

    def compile_json_object(self) -> xgr.CompiledGrammar:
        """OpenAI JSON mode: any JSON object (same entry as json_schema=JSON_OBJECT_SCHEMA)."""
        return self._future(("json", json.dumps(JSON_OBJECT_SCHEMA, separators=(",", ":")))).result()

    def cache_size(self) -> int:
        return len(self._cache)

    def _future(self, key: GrammarKey) -> Future:
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile_key, key)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile_key(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, text = key
        if kind == "json":
            try:
                check_json_schema(json.loads(text))
            except RecursionError:
                raise GrammarError("json_schema nests too deeply to check: flatten it") from None
            try:
                return self._compiler.compile_json_schema(
                    text, any_whitespace=self.any_whitespace, max_whitespace_cnt=self.max_whitespace_cnt
                )
            except Exception as e:
                raise GrammarError(f"unsupported or invalid JSON schema: {_clean_error(e)}") from e
        if kind == "regex":
            try:
                return self._compiler.compile_regex(text)
            except Exception as e:
                raise GrammarError(f"invalid regex {text!r}: {_clean_error(e)}") from e
        try:
            return self._compiler.compile_grammar(text)
        except Exception as e:
            raise GrammarError(
                f"invalid EBNF grammar: {_clean_error(e)} (xgrammar GBNF syntax; the start rule is 'root')"
            ) from e

    # ---- per request -----------------------------------------------------------------------

    def new_state(self, params: "SamplingParams", stop_token_ids: Iterable[int] | None = None) -> GrammarState | None:
        """A fresh matcher for one request (None when it has no constraint)."""
        compiled = self.compile(params)
        return None if compiled is None else GrammarState(compiled, stop_token_ids)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """A [batch_size, ceil(vocab_size/32)] int32 CPU bitmask; pinned when CUDA is present so
        apply_bitmask's copy to the device is asynchronous. Allocate once, reuse every step."""
        bitmask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        return bitmask.pin_memory() if torch.cuda.is_available() else bitmask

    def apply(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """One decode step's masking: fill_bitmask + apply_bitmask on a buffer the backend keeps
        (grown to the largest batch seen). logits row i belongs to states[i]."""
        if self._bitmask is None or self._bitmask.shape[0] < len(states):
            self._bitmask = self.allocate_bitmask(max(len(states), 8))
        rows = fill_bitmask(states, self._bitmask)
        apply_bitmask(logits, self._bitmask, rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """The grammar position of one request (wraps xgrammar.GrammarMatcher).

    Once the grammar is complete only stop tokens are allowed; accepting one terminates the state,
    and the scheduler must then finish the request (reason "stop", like an ordinary eos).
    """

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int] | None = None) -> None:
        stops = sorted({int(t) for t in stop_token_ids}) if stop_token_ids else None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (state unchanged: the
        scheduler should abort the request rather than continue off-grammar)."""
        return self.matcher.accept_token(int(token_id))

    def accept_string(self, text: str) -> bool:
        return self.matcher.accept_string(text)

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request is done."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The grammar is fully matched: only stop tokens are allowed next."""
        return self.matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding, retraction)."""
        self.matcher.rollback(num_tokens)

    def reset(self) -> None:
        self.matcher.reset()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


_batch_matcher: xgr.BatchGrammarMatcher | None = None


def _get_batch_matcher() -> xgr.BatchGrammarMatcher:
    global _batch_matcher
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=2)
    return _batch_matcher


def fill_bitmask(states: Sequence[GrammarState | None], bitmask: torch.Tensor) -> list[int]:
    """Fill bitmask row i with the allowed next tokens of states[i]; returns the constrained rows.

    Rows without a live grammar (None or terminated) are reset to allow everything, so applying
    the whole bitmask leaves their logits untouched; passing the returned rows as apply_bitmask's
    indices skips them altogether. The bitmask must be on the CPU.
    """
    rows = [i for i, s in enumerate(states) if s is not None and not s.matcher.is_terminated()]
    if len(rows) < len(states):
        constrained = set(rows)
        bitmask[[i for i in range(len(states)) if i not in constrained]] = -1
    if len(rows) == 1:
        states[rows[0]].matcher.fill_next_token_bitmask(bitmask, rows[0])  # type: ignore[union-attr]
    elif rows:
        matchers = [states[i].matcher for i in rows]  # type: ignore[union-attr]
        _get_batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, rows)
    return rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int] | None = None) -> None:
    """Set disallowed logits to -inf in place (logits [B, V] on any device, CPU bitmask).

    indices: the rows to mask (fill_bitmask's return); None masks rows 0..B-1. An empty list is a
    no-op. The bitmask is copied to logits.device without blocking the host.
    """
    if indices is not None and len(indices) == 0:
        return
    rows = logits.shape[0]
    if bitmask.shape[0] > rows and indices is None:
        bitmask = bitmask[:rows]
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(indices) if indices is not None else None)


def accept_tokens(states: Sequence[GrammarState | None], token_ids: Sequence[int]) -> list[bool]:
    """accept_token for every constrained row (True for rows without a grammar)."""
    return [True if s is None else s.matcher.accept_token(int(t)) for s, t in zip(states, token_ids)]
