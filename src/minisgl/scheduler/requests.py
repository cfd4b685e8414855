"""Requests in and out: the checks a request must pass, its sequences, its stop rules, its outputs."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

import torch

from minisgl.config import EngineConfig
from minisgl.core import Req, SamplingParams, TokenOutput
from minisgl.errors import InvalidRequestError, OutOfMemoryError, PromptTooLongError
from minisgl.tokenizer import IncrementalDetokenizer


def check_request(
    input_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    page_size: int,
    num_pages: int,
    known_valid: int = 0,
) -> None:
    """Raise a typed error for a request that can never be served (grammar aside); changes nothing.

    known_valid: how many leading tokens are known to be in range (the prefix cache holds them: they were checked
    when first seen); only the rest is scanned, which on a long shared prompt is most of this check's time.
    """
    if not input_ids:
        raise InvalidRequestError("empty prompt: give at least one token")
    rest = input_ids[known_valid:] if known_valid else input_ids
    if rest and (min(rest) < 0 or max(rest) >= vocab_size):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size}) for this model")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size}) for this model")
    if len(input_ids) >= max_seq_len:
        raise PromptTooLongError(
            f"prompt has {len(input_ids)} tokens but the context window is {max_seq_len}: "
            "shorten the prompt (or raise max_seq_len up to the model's limit)"
        )
    pages_needed = -(-(len(input_ids) + 1) // page_size)
    if pages_needed > num_pages:
        raise OutOfMemoryError(
            f"the prompt needs {pages_needed} KV pages but the pool has {num_pages}: "
            "give the KV cache more memory (kv_cache_gb / mem_fraction / num_pages)"
        )


def new_reqs(
    rid: str,
    input_ids: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    share_prompt: bool,
    received: Callable[[Req], None] | None = None,
    embed: bool = False,
) -> list[Req]:
    """The request's n sequences; with share_prompt the later ones wait for the first's prompt KV.

    received(req) (the plugins' hook) may reject a sequence: it raises before any is returned.
    """
    now = time.perf_counter()
    new: list[Req] = []
    for i in range(params.n):
        seed = params.seed + i if params.seed is not None else None
        req = Req(
            rid=rid,
            input_ids=list(input_ids),
            sampling_params=params,
            prompt_len=len(input_ids),
            eos_token_ids=eos_token_ids,
            index=i,
            seed=seed,
            arrival=now,
            embed=embed,
        )
        req.wait_for = new[0] if new and share_prompt else None
        if received is not None:
            received(req)
        new.append(req)
    return new


def init_req_state(req: Req, device: torch.device, tokenizer: Callable[[], Any], grammar: Callable[[], Any]) -> None:
    """The request's sampling state: its generator, stop-string checker and grammar matcher (tokenizer and grammar
    give the model's, loaded on first use)."""
    p = req.sampling_params
    if req.seed is not None:
        req.generator = torch.Generator(device=device).manual_seed(req.seed)
    if p.stop:
        req.stop_checker = IncrementalDetokenizer(tokenizer(), p.stop, p.skip_special_tokens, p.min_tokens)
    if p.has_grammar:
        req.grammar = grammar().new_state(p, stop_token_ids=sorted(req.eos_token_ids))
    if p.grammar_after is not None:
        req.grammar_gate = IncrementalDetokenizer(tokenizer(), [p.grammar_after], skip_special_tokens=False)


def grammar_accepts(req: Req, token: int) -> bool:
    """Advance req's grammar by its new token; False if the grammar rejects it. Before grammar_after is written
    the token only moves the gate (the token that completes it is not the grammar's either)."""
    if req.grammar_gate is not None:
        req.grammar_gate.add([token])
        if req.grammar_gate.stopped is not None:
            req.grammar_gate = None
        return True
    return req.grammar is None or req.grammar.accept_token(token)


def stop_reason(req: Req, token: int, max_seq_len: int) -> tuple[str | None, Any]:
    """(finish reason, matched stop) once `token` was appended to req; (None, None) to go on."""
    p = req.sampling_params
    if req.stop_checker is not None:
        req.stop_checker.add([token])
    min_ok = req.num_output >= p.min_tokens
    if min_ok and not p.ignore_eos and token in req.eos_token_ids:
        return "stop", token
    if min_ok and token in p.stop_token_ids:
        return "stop", token
    if req.stop_checker is not None and req.stop_checker.stopped is not None:
        return "stop", req.stop_checker.stopped
    if req.grammar is not None and req.grammar.is_terminated():
        return "stop", None
    if req.num_output >= p.max_tokens or req.seq_len >= max_seq_len:
        return "length", None
    return None, None


class Finish(NamedTuple):
    """What ends a sequence (Scheduler._finish): the reason, the stop that matched, the tokens and logprobs of its
    last output, and for a failure the message and the minisgl.errors class name the client raises."""

    reason: str  # "stop" | "length" | "abort"
    matched: Any = None  # the stop string or token id
    new_tokens: list[int] = []  # noqa: RUF012 - never mutated: a NamedTuple's default
    new_logprobs: list[Any] | None = None
    error: str | None = None
    error_type: str | None = None


def make_output(
    req: Req,
    new: list[int],
    logprobs: Any,
    finished: bool,
    error: str | None = None,
    error_type: str | None = None,
) -> TokenOutput:
    return TokenOutput(
        rid=req.rid,
        index=req.index,
        new_token_ids=new,
        new_logprobs=logprobs,
        finished=finished,
        finish_reason=req.finish_reason,
        matched_stop=req.matched_stop,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.prefix_hit_len,
        completion_tokens=req.num_output,
        error=error,
        error_type=error_type,
        # Once, with the sequence's first output (the one whose new tokens are all of its tokens so far).
        prompt_logprobs=req.prompt_logprobs if len(new) == req.num_output else None,
        embedding=req.embedding if len(new) == req.num_output else None,
        spec_accepted_tokens=req.spec_accepted,
    )


class Grammars:
    """The grammar backend of structured outputs, built on first use."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, config: EngineConfig) -> None:
        self.tokenizer = tokenizer  # the model's, loaded on first use
        self.vocab_size = vocab_size
        self.config = config
        self._backend: Any = None

    def backend(self) -> Any:
        if self._backend is None:
            # The tokenizer first: its background load (TokenizerLoad) imports transformers, and xgrammar imports it
            # too; two threads importing transformers at once can see it half initialised.
            tokenizer = self.tokenizer()
            from minisgl.structured.grammar import GrammarBackend

            c = self.config
            self._backend = GrammarBackend(
                tokenizer,
                self.vocab_size,
                max_whitespace_cnt=12,  # bounded whitespace: weak models otherwise loop on blanks inside JSON
                max_bytes=c.max_grammar_bytes,
                max_depth=c.max_schema_depth,
                compile_timeout=c.grammar_compile_timeout,
            )
        return self._backend

    def bitmask_fn(self, reqs: list[Req]) -> Callable[[torch.Tensor], Any] | None:
        """The function masking the logits of reqs' rows by their grammars; None when none has one."""
        states = [r.grammar if r.grammar_gate is None else None for r in reqs]  # a gated grammar masks nothing yet
        if not any(s is not None for s in states):
            return None
        backend = self.backend()
        return lambda logits: backend.apply(logits, states)


class GrammarWait(NamedTuple):
    """The sequences of a request whose grammar is still compiling (off the loop), until `deadline`."""

    reqs: list[Req]
    future: Future
    deadline: float

    def error(self, timeout: float) -> Exception | None:
        """Why the request fails (a compile error, or the timeout), or None once its grammar is ready."""
        from minisgl.structured.grammar import compile_timeout_error

        if not self.future.done():
            return compile_timeout_error(timeout)
        return self.future.exception()
