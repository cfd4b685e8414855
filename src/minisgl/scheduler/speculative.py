"""N-gram speculative decoding: draft tokens for the decode rows, one forward that verifies them, the KV settled after.

A decode step whose rows have drafts (ngram.py) runs as an extend batch instead: each row computes its last sampled
token followed by its k draft tokens, on KV slots reserved for all k + 1, and the engine scores every position
(engine/verify.py). The accepted tokens' KV stays, the rejected ones' pages go back (ReqKV.shrink), and the radix
cache only ever sees the kept tokens (a request's KV is cached from its tokens up to cached_len).

k adapts per request: the chance that a draft token is accepted is estimated from the request's recent drafts over
the acceptance of every request's drafts of the same context length (a 4-token context repeats a copied passage, a
1-token one rarely predicts prose), and the draft is cut to the length whose expected tokens best beat its cost; a
step speculates only when its rows' expected gains beat the extend path's own cost. A text that repeats nothing is
then decoded plainly, and a batch large enough to be compute-bound is never speculated.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.kv import ReqKV
from minisgl.scheduler.ngram import NgramIndex, SharedNgrams, propose

MAX_DRAFT = 8  # draft tokens per row and step, at most
# A verify step's cost relative to a plain decode step of the same rows: 1 + SWITCH + TOKEN * sqrt(rows) per draft
# token (the fixed overhead of a verify step; each draft token's share of the weights' pass, larger per row as the
# batch nears compute-bound). CPU: measured with SmolLM2-135M at batch 1, 4 and 16 (docs/benchmarks.md). CUDA: on an
# H200 (Qwen3-0.6B shape) a batch-1 verify step of 9 tokens, replayed from the decode graphs, costs 2.0 decode steps:
# it waits for the previous step's tokens (no overlap) and its host work is not hidden behind the GPU's.
COST = {"cpu": (0.15, 0.1), "cuda": (0.85, 0.02)}
MARGIN = 0.05  # the gain a step must promise over its cost to speculate (noise in the estimates)
# Beyond these a batch is never speculated (no drafting work): on CUDA the verify rows (k + 1 per row) must fit the
# decode graphs, and workload A's batches of 17-256 rows lost 17% to drafting.
MAX_ROWS = {"cpu": 32, "cuda": 16}
# Tokens filed into the n-gram indexes per drafting step, at most (one sequence at least): the finished sequences for
# the shared index, then the rows' own backlogs (a new request's prompt). Many long prompts admitted at once are filed
# over several steps, behind the GPU's work, instead of stalling one (~0.7 us of host time a token: 16 rows of 2,000
# tokens at once took ~25 ms). A row drafts once its own index is whole.
FILE_BUDGET = 512
# A request is drafted for only if it started decoding in a batch small enough to draft: one first met with more
# than this many tokens sampled decoded them in a large batch, and decodes plainly to its end. Indexing such rows'
# texts (prompt and output, ~1,500 tokens each in workload A) as a large batch thins out, and filing their finished
# neighbours' answers, cost workload A's last steps 1-2% of the whole run on the host, for drafts that rarely pay.
LATE = 64
_UNMET: Any = object()  # states' default: a request not met yet
FIRST_RATES = (0.0, 0.25, 0.4, 0.6, 0.8)  # per context length 0..MAX_N, until drafts of that length were verified
PRIOR = 2.0  # pseudo-trials of the context length's acceptance behind a request's own
DECAY = 0.9  # a request's own evidence fades with each verify: a copied passage ends, a new one starts
BACKOFF_FIRST, BACKOFF_MAX = 1, 32  # tokens a request decodes without drafting after a wholly rejected draft, doubled
# each time
FADE = 0.95  # and with each step it does not draft, so that a request that stopped drafting tries again later


class Acceptance:
    """Decayed counts of draft tokens accepted (successes) out of those tried before the first rejection."""

    __slots__ = ("successes", "trials")

    def __init__(self, successes: float = 1.0, trials: float = 2.0) -> None:
        self.successes, self.trials = successes, trials

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self.successes = self.successes * decay + accepted
        self.trials = self.trials * decay + accepted + (accepted < drafted)

    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0


class SpecState:
    """One sequence's drafting state: its n-gram index, its acceptance, the context length of its last draft."""

    __slots__ = ("index", "own", "n", "resume_at", "backoff")

    def __init__(self, tokens: list[int]) -> None:
        self.index = NgramIndex(tokens)
        self.own = Acceptance(0.0, 0.0)
        self.n = 0
        # After a draft of which nothing was accepted: the number of sampled tokens from which the request drafts again
        # (counted in tokens, not in calls: under overlap scheduling only a step that may draft asks for drafts)
        self.resume_at = 0
        self.backoff = BACKOFF_FIRST

    def rate(self, prior: float) -> float:
        """The chance the next draft token is accepted: this request's record over its context length's."""
        return (self.own.successes + PRIOR * prior) / (self.own.trials + PRIOR)


def best_draft(rate: float, available: int, token_cost: float) -> tuple[int, float]:
    """(draft length, expected extra tokens net of its cost) that pays most; (0, 0.0) when none pays.

    A k-token draft emits sum(rate**i for i in 1..k) extra tokens on average (accepted until the first miss), so its
    k-th token adds rate**k - token_cost, less with each k: the best length is the last one whose token still adds.
    Every row of every drafting step asks, so this is one pass."""
    best, gain, p = 0, 0.0, 1.0
    for k in range(1, available + 1):
        p *= rate
        if p <= token_cost:
            break
        best, gain = k, gain + p - token_cost
    return best, gain


class Speculator:
    def __init__(self, kv: ReqKV, max_seq_len: int, device_type: str) -> None:
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.shared = SharedNgrams()
        self.max_rows = MAX_ROWS.get(device_type, MAX_ROWS["cuda"])
        self.switch_cost, self.token_cost = COST.get(device_type, COST["cuda"])
        self.states: weakref.WeakKeyDictionary[Req, SpecState | None] = weakref.WeakKeyDictionary()
        # Every request's acceptance per matched context length, from a prior: longer contexts predict better.
        self.by_context = [Acceptance(2.0 * rate, 2.0) for rate in FIRST_RATES]
        self.drafted = 0  # draft tokens verified, over every request (the Prometheus counters)
        self.accepted = 0
        self.verify_rows = 0  # rows verified with a draft (accepted / verify_rows: the mean accepted length - 1)
        # Tensor parallelism (runtime/tp.py): rank 0 decides and sends each decision to the other ranks (lead), which
        # take it instead of deciding (follow), so that every rank verifies the same drafts. None with one rank.
        self.lead: Callable[[str, Any], None] | None = None
        self.follow: Callable[[str, int], Any] | None = None

    def drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each row's draft for the next step ([] for none); None when no draft pays for the step (plain decode)."""
        if len(reqs) > self.max_rows:  # every rank knows: nothing to send
            return None
        return self._decision("drafts", reqs, self._drafts)

    def may_draft(self, reqs: list[Req]) -> bool:
        """Whether a decode step of reqs could speculate (_may_draft), so that the step waits for its tokens."""
        if not reqs or len(reqs) > self.max_rows:
            return False
        return self._decision("may_draft", reqs, self._may_draft)

    def _decision(self, kind: str, reqs: list[Req], decide: Callable[[list[Req]], Any]) -> Any:
        """decide(reqs) here, sent on to the other ranks (lead); or rank 0's, received (follow)."""
        if self.follow is not None:
            return self.follow(kind, len(reqs))
        out = decide(reqs)
        if self.lead is not None:
            self.lead(kind, out)
        return out

    def _drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """drafts() decided here.

        A row's draft pays when its expected extra tokens beat its share of the step's cost (best_draft); the step
        speculates when the rows' gains together beat the extend path's fixed cost for the whole batch."""
        per_token = self.token_cost * len(reqs) ** 0.5  # a draft token's cost in plain rows' tokens
        out: list[list[int]] = []
        found: list[SpecState] = []
        total = 0.0
        for req, state in zip(reqs, self._indexed(reqs)):
            draft, gain = self._draft(req, state, per_token) if state is not None else ([], 0.0)
            out.append(draft)
            if draft:
                found.append(state)
            total += gain
        if total < len(reqs) * (self.switch_cost + MARGIN):
            for state in found:
                state.own.add(0, 0, FADE)  # not tried: the request's record fades to its prior
            return None
        return out

    def _may_draft(self, reqs: list[Req]) -> bool:
        """Whether a decode step of reqs could speculate, judged on the tokens the host has: under overlap scheduling
        each row's last one is still on the device. Only a step that could waits for them (drafts() then decides
        on all of them); any other keeps overlapping. A row whose known context continues somewhere is likely
        still in the passage it repeats, so the lagged judgement seldom differs from the full one. A step judged
        not to speculate lets its drafting rows' records fade, as drafts() does (under overlap drafts() is asked only
        after a True here: without this, a request whose drafts were rejected would never draft again)."""
        per_token = self.token_cost * len(reqs) ** 0.5
        total = 0.0
        found: list[SpecState] = []
        for req, state in zip(reqs, self._indexed(reqs)):
            if state is None or req.num_sampled < state.resume_at or req.grammar_gate is not None:
                continue
            draft, n = propose(state.index, self.shared if req.seed is None else None, MAX_DRAFT)
            if draft:
                total += best_draft(state.rate(self.by_context[n].rate), len(draft), per_token)[1]
                found.append(state)
        if total >= len(reqs) * (self.switch_cost + MARGIN):
            return True
        for state in found:
            state.own.add(0, 0, FADE)
        return False

    def _indexed(self, reqs: list[Req]) -> list[SpecState | None]:
        """Each row's drafting state; None for a row met late (LATE) or while its own index is still being filed
        (FILE_BUDGET a call, finished sequences for the shared index first, when any row drafts at all)."""
        states = [self._state(req) for req in reqs]
        budget = FILE_BUDGET
        if any(state is not None for state in states):
            budget -= self.shared.file_pending(FILE_BUDGET)
        out: list[SpecState | None] = []
        for state in states:
            if state is not None:
                budget -= state.index.sync(budget)
            out.append(state if state is not None and state.index.synced else None)
        return out

    def _state(self, req: Req) -> SpecState | None:
        """req's drafting state, made when first met; None for a request met late: it decodes plainly to its end."""
        state = self.states.get(req, _UNMET)
        if state is _UNMET:
            state = self.states[req] = SpecState(req.input_ids) if req.num_output <= LATE else None
        return state

    def _draft(self, req: Req, state: SpecState, per_token: float) -> tuple[list[int], float]:
        if req.num_sampled < state.resume_at:
            return [], 0.0
        p = req.sampling_params
        # Every emitted token must fit max_tokens and the context window: the draft, then the target's own token.
        k = min(MAX_DRAFT, p.max_tokens - req.num_output - 1, self.max_seq_len - req.seq_len - 1)
        if k <= 0 or req.grammar_gate is not None:
            return [], 0.0
        # A seeded request drafts from its own tokens only: its output must not depend on other requests.
        draft, state.n = propose(state.index, self.shared if req.seed is None else None, k)
        if not draft:
            return [], 0.0
        stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | req.eos_token_ids
        for i, token in enumerate(draft):
            if token in stops:  # nothing follows a stop token
                draft = draft[: i + 1]
                break
        if req.grammar is not None:
            draft = _grammar_prefix(req.grammar, draft)
        k, gain = best_draft(state.rate(self.by_context[state.n].rate), len(draft), per_token)
        return draft[:k], gain

    def verify_batch(self, reqs: list[Req], drafts: list[list[int]]) -> Batch:
        """The decode rows as an extend batch of each row's last token and draft (its `drafts`), slots reserved for
        the drafts after each row's reserved next token (a row whose draft finds no pages runs without it)."""
        tokens: list[int] = []
        chosen = []
        kept = []
        for req, draft in zip(reqs, drafts):
            if draft and not self.kv.reserve_after(req, req.cached_len + 1, len(draft)):
                draft = []
            tokens.append(req.input_ids[-1])
            tokens.extend(draft)
            chosen.append((req, 1 + len(draft)))
            kept.append(draft)
        verify = self.kv.make_batch(Phase.PREFILL, chosen, tokens)
        verify.sample_mask = [True] * verify.size
        verify.drafts = kept
        return verify

    def settle(self, req: Req, drafted: int, accepted: int) -> None:
        """Count a row's verify outcome and learn from it (its KV: ReqKV.shrink)."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_rows += drafted > 0
        req.spec_accepted += accepted  # its usage reports them
        state = self.states.get(req)
        if state is not None and drafted:
            state.own.add(drafted, accepted, DECAY)
            if accepted:
                state.backoff = BACKOFF_FIRST
            else:
                # The row emits one token (the target's own) in this verify step, then backs off.
                state.resume_at = req.num_sampled + 1 + state.backoff
                state.backoff = min(BACKOFF_MAX, state.backoff * 2)
            self.by_context[state.n].add(drafted, accepted, 0.99)

    def finished(self, req: Req) -> None:
        """A sequence ended: its output's contexts become drafts for the others (not an aborted one's)."""
        if req.finish_reason in ("stop", "length") and req.num_output > 1:
            self.shared.add(req.input_ids, req.prompt_len)

    def stats(self) -> dict[str, int]:
        return {
            "spec_drafted_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_verify_rows": self.verify_rows,
        }


def _grammar_prefix(grammar: Any, draft: list[int]) -> list[int]:
    """The longest prefix of draft the grammar accepts (its state is left as it was)."""
    n = 0
    for token in draft:
        if grammar.is_terminated() or not grammar.accept_token(token):
            break
        n += 1
    if n:
        grammar.rollback(n)
    return draft[:n]
