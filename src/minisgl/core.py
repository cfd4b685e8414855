"""The nouns everything shares: SamplingParams, Req and Batch."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from minisgl.errors import GrammarError, InvalidRequestError

if TYPE_CHECKING:
    import torch


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction; bad values raise InvalidRequestError."""

    temperature: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: to the end of the context window (the daemon resolves it)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: int | None = None  # None: off; k >= 0: chosen token plus top-k alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none); computes the whole prompt
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100], added to the logits
    # Structured output: at most one of these (see minisgl.structured).
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    # The grammar constrains only what follows this text (a reasoning model's "</think>"): free until it is written.
    grammar_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise InvalidRequestError(
                f"invalid SamplingParams: stop_token_ids must be a list of token ids, got {ids!r}"
            )
        self.stop_token_ids = [int(t) for t in ids]
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        if _is_int(self.max_tokens) and self.max_tokens > _INT64_MAX:
            self.max_tokens = _INT64_MAX  # as any max_tokens past the context: it stops at the context's end
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams: {msg}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number, got {value!r}")
        for name in ("n", "min_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        for name in ("n", "min_tokens", "top_k"):  # past int64 they cannot even be sent
            if (getattr(self, name) or 0) > _INT64_MAX:
                raise bad(f"{name}={getattr(self, name)} is too large: at most the model's context window makes sense")
        if any(not -_INT64_MAX <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids must be token ids of the model's vocabulary")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise bad(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0 (1.0 is off), got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad(f"prompt_logprobs must be None or an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise bad(f"seed must be a 64-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if sum(c is not None for c in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise GrammarError("give at most one of json_schema, regex and ebnf")
        if self.grammar_after is not None and (not isinstance(self.grammar_after, str) or not self.grammar_after):
            raise bad(f"grammar_after must be None or a non-empty string, got {self.grammar_after!r}")
        if self.grammar_after is not None and not self.has_grammar:
            raise bad("grammar_after needs a grammar (json_schema, regex or ebnf) to start after it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        """Validated params from a mapping of field names (what a client sends); None: the defaults."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise InvalidRequestError(f"sampling params must be a mapping, got {type(d).__name__}")
        unknown = set(d) - _FIELD_NAMES
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameters: {sorted(unknown)}")
        try:
            return cls(**d)
        except InvalidRequestError:
            raise
        except (TypeError, ValueError) as e:  # a value of the wrong type that a conversion met first
            raise InvalidRequestError(f"invalid SamplingParams: {e}") from e

    @classmethod
    def from_validated(cls, d: dict[str, Any]) -> "SamplingParams":
        """Params that to_dict() wrote after validation, inside the daemon (tokenizer -> scheduler): not checked
        again."""
        params = cls.__new__(cls)
        params.__dict__.update(d)
        return params

    def for_prompt(self, prompt_len: int, context_length: int) -> "SamplingParams":
        """These params with an unset max_tokens resolved: the rest of the context window after the prompt."""
        if self.max_tokens is not None:
            return self
        params = copy.copy(self)
        params.max_tokens = max(1, context_length - prompt_len)
        return params

    @classmethod
    def for_embedding(cls) -> "SamplingParams":
        """An embedding request's params: its one greedy token ends it (the vector comes from the prefill)."""
        return cls(max_tokens=1, temperature=0.0, ignore_eos=True)

    def with_grammar(self, **grammar: Any) -> "SamplingParams":
        """A copy constrained by one grammar field (json_schema, regex or ebnf); these params have none."""
        if self.has_grammar:
            raise GrammarError("give at most one of json_schema, regex and ebnf")
        ((name, value),) = grammar.items()
        assert name in ("json_schema", "regex", "ebnf"), name
        params = copy.copy(self)
        setattr(params, name, value)
        return params


_INT64_MAX = 2**63 - 1  # the largest integer the wire protocol (msgpack) carries


def int64_overflow(value: Any, clamped: frozenset[str] = frozenset()) -> tuple[str, int] | None:
    """The first integer of a JSON-like value (dicts, lists, tuples; keys too) outside the 64 bits msgpack carries,
    and where it is ("prompt[3]", "options.seed"); None when every one fits. Values of the keys in `clamped` may
    be larger (a max_tokens past any context: SamplingParams clamps it). Iterative: a deep value recurses nowhere."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, v in item.items():
                if type(key) is int and not -_INT64_MAX - 1 <= key <= _INT64_MAX:
                    return _path(where), key
                if type(v) is int:
                    if not -_INT64_MAX - 1 <= v <= _INT64_MAX and not (key in clamped and v > 0):
                        return _path((*where, key)), v
                elif isinstance(v, (dict, list, tuple)):
                    stack.append((v, (*where, key)))
        elif isinstance(item, (list, tuple)):
            for i, v in enumerate(item):
                if type(v) is int:
                    if not -_INT64_MAX - 1 <= v <= _INT64_MAX:
                        return _path((*where, i)), v
                elif isinstance(v, (dict, list, tuple)):
                    stack.append((v, (*where, i)))
        elif type(item) is int and not -_INT64_MAX - 1 <= item <= _INT64_MAX:
            return _path(where), item
    return None


def _path(where: tuple[Any, ...]) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".")
    return text or "the value"


def describe_int(value: int) -> str:
    """An integer as a message shows it: its digits, or its size when it is huge."""
    return str(value) if abs(value) < 10**30 else f"an integer of {value.bit_length()} bits"


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _is_int(value: Any) -> bool:
    """An integer, and not a bool (True is an int to Python, not a count to a request)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _token_biases(bias: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, keys as strings in JSON) as {int: float}; None when empty."""
    if not isinstance(bias, Mapping):
        raise InvalidRequestError(f"invalid SamplingParams: logit_bias must map token ids to biases, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"invalid SamplingParams: logit_bias key {key!r} is not a token id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise InvalidRequestError(
                f"invalid SamplingParams: logit_bias values must be in [-100, 100], got {value!r}"
            )
        if not 0 <= token <= _INT64_MAX:
            raise InvalidRequestError(f"invalid SamplingParams: logit_bias key {key!r} is not a token id")
        out[token] = float(value)
    return out or None


class TokenOutput(NamedTuple):
    """What the scheduler reports for one sequence after a step (crosses the process boundary)."""

    rid: str  # the user's request id
    index: int  # which of the n samples (0 when n == 1)
    new_token_ids: list[int]
    new_logprobs: list[Any] | None  # per new token: (logprob, [(token_id, logprob), ...top-k]) or None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    matched_stop: str | int | None  # the stop string or token id that ended it
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int
    error: str | None = None  # set when finish_reason is "abort" because of a failure
    error_type: str | None = None  # the minisgl.errors class of that failure (default RequestAbortedError)
    # With SamplingParams.prompt_logprobs, on the first output of sample 0: per prompt token, as new_logprobs
    # (None for the first token, which nothing predicts).
    prompt_logprobs: list[Any] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its first (and last) output
    spec_accepted_tokens: int = 0  # of completion_tokens, draft tokens accepted (speculative decoding)


class Phase(enum.Enum):
    PREFILL = "prefill"  # extend: new prompt tokens (possibly after a cached prefix, possibly a chunk)
    DECODE = "decode"  # one new token per request


@dataclass(eq=False)  # a request is itself: identity, not field-by-field equality (and hashable)
class Req:
    """One sequence in flight.

    input_ids holds every token of the sequence known so far (prompt, then generated tokens);
    the first cached_len of them have their KV in the pool (slots in page_table[table_idx]).
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    prompt_len: int
    eos_token_ids: frozenset[int] = frozenset()
    seed: int | None = None
    # Where this sequence lives in the cache.
    table_idx: int = -1
    index: int = 0  # which of the request's n samples
    cached_len: int = 0  # tokens whose KV is in the pool
    matched_len: int = 0  # leading tokens whose pages the prefix cache owns (page aligned)
    prefix_hit_len: int = 0  # prompt tokens served from the prefix cache (first admission)
    cache_handle: Any = None  # the prefix cache node this request locks
    prefix_hint: Any = None  # where the last walk of its prompt in the prefix cache ended, to resume there
    # Output state.
    output_ids: list[int] = field(default_factory=list)
    tokens_in_flight: int = 0  # sampled on the device, not yet read on the host (overlap scheduling)
    output_logprobs: list[Any] = field(default_factory=list)
    spec_accepted: int = 0  # of output_ids, draft tokens accepted (speculative decoding)
    prompt_logprobs: list[Any] | None = None  # filled chunk by chunk while the prompt is computed (prompt_logprobs)
    embed: bool = False  # an embedding request: its prompt's pooled hidden state is the answer (one token is sampled)
    embedding: list[float] | None = None  # set by the prefill chunk that computes the last prompt token
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    arrival: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    wait_for: "Req | None" = None  # prefill after this one (n > 1 siblings share its prompt KV)
    skipped: int = 0  # times prefix-aware ordering passed it over (fairness bound)
    # Per-request state owned by other components (grammar matcher, stop-string decoder, generator).
    grammar: Any = None
    grammar_gate: Any = None  # with grammar_after: watches the output for it; None once the grammar applies
    stop_checker: Any = None
    generator: Any = None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids)

    @property
    def extend_len(self) -> int:
        return len(self.input_ids) - self.cached_len

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Sample 0 of a request with prompt_logprobs whose prompt logprobs are not all in: its prefill
        computes every prompt token (a cached prefix would have no logits)."""
        have = 0 if self.prompt_logprobs is None else len(self.prompt_logprobs)
        return self.sampling_params.prompt_logprobs is not None and self.index == 0 and have < self.prompt_len

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far, those still in flight on the device included."""
        return len(self.output_ids) + self.tokens_in_flight


@dataclass
class Batch:
    """The requests of one forward pass, flattened into tensors by the scheduler.

    input_ids, positions and out_loc have one entry per token computed in this pass;
    extend_lens[i] tokens of reqs[i] are computed on top of prefix_lens[i] cached ones.
    """

    reqs: list[Req]
    phase: Phase
    input_ids: "torch.Tensor"  # [num_tokens] int64
    positions: "torch.Tensor"  # [num_tokens] int64
    out_loc: "torch.Tensor"  # [num_tokens] int64 KV slots written by this pass
    table_rows: "torch.Tensor"  # [bs] int64 rows of the page table
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]  # prefix + extend
    # Requests in a chunked prefill whose last computed token is not their last prompt token
    # produce no sample; sample_mask[i] is False for them.
    sample_mask: list[bool] = field(default_factory=list)
    attn_metadata: Any = None  # owned by the attention backend
    padded_size: int = 0  # CUDA graphs: batch size after padding
    # A verify batch (speculative decoding) of decoding rows: row i computes its last sampled token, then drafts[i]
    drafts: list[list[int]] | None = None

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def is_prefill(self) -> bool:
        return self.phase is Phase.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.phase is Phase.DECODE

    @property
    def is_verify(self) -> bool:
        return self.drafts is not None


def flatten(xs: Sequence[Sequence[int]]) -> list[int]:
    return [x for seq in xs for x in seq]


@dataclass
class CompletionOutput:
    """One of the n sampled sequences of a request (offline LLM and daemon clients alike)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls"
    matched_stop: str | int | None = None  # the stop string or token id that ended it
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI-shaped {id, type, function: {name, arguments}}
    logprobs: list[Any] | None = None  # per token; the client's are {token_id, token, logprob, top_logprobs}
    reasoning_content: str | None = None  # the <think> part, apart from text, when the daemon has a reasoning parser
    finish_detail: str | None = None  # daemon clients: what to know of the finish (a grammar cut off by max_tokens)


class FirstOutputShortcuts:
    """text / token_ids / finish_reason of outputs[0], the only output unless n > 1 (for result classes)."""

    @property
    def text(self) -> str:
        return self.outputs[0].text  # type: ignore[attr-defined]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids  # type: ignore[attr-defined]

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason  # type: ignore[attr-defined]
