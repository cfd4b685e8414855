"""N-gram speculative decoding: draft tokens for the decode rows, one forward that verifies them, the KV settled after.

A decode step whose rows have drafts (ngram.py) runs as an extend batch instead: each row computes its last sampled
token followed by its k draft tokens, on KV slots reserved for all k + 1, and the engine scores every position
(engine/verify.py). The accepted tokens' KV stays, the rejected ones' pages go back (ReqKV.shrink), and the radix
cache only ever sees the kept tokens (a request's KV is cached from its tokens up to cached_len).

k adapts per request: it grows while whole drafts are accepted and falls to what was accepted after a miss; a request
whose drafts keep failing stops drafting for a while (longer after each failure), so a text that repeats nothing
costs almost nothing. A batch large enough to be compute-bound is not speculated at all.
"""

from __future__ import annotations

import weakref
from typing import Any

from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.kv import ReqKV
from minisgl.scheduler.ngram import NgramIndex, SharedNgrams, propose

MAX_DRAFT = 8  # draft tokens per row and step, at most
FIRST_DRAFT = 4  # a request's first drafts
BACKOFF_FIRST, BACKOFF_MAX = 2, 64  # decode steps a failing request skips drafting: doubled per failure up to this
# Above these a decode batch is compute-bound (verifying costs as much as it saves): rows per batch, draft tokens per
# step. Measured on the CPU with SmolLM2-135M (docs/benchmarks.md); a GPU stays memory-bound far longer.
MAX_ROWS = {"cpu": 16, "cuda": 64}
MAX_DRAFT_TOKENS = {"cpu": 48, "cuda": 512}


class SpecState:
    """One sequence's drafting state: its n-gram index, its next draft length, its back-off, its counts."""

    __slots__ = ("index", "k", "skip", "backoff", "drafted", "accepted")

    def __init__(self, tokens: list[int]) -> None:
        self.index = NgramIndex(tokens)
        self.k = FIRST_DRAFT
        self.skip = 0  # decode steps left without drafting
        self.backoff = BACKOFF_FIRST
        self.drafted = 0
        self.accepted = 0

    def settle(self, drafted: int, accepted: int) -> None:
        """Adapt to a verify step's outcome."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(MAX_DRAFT, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:  # a wasted verify: pause drafting, longer each time in a row
            self.skip, self.backoff = self.backoff, min(BACKOFF_MAX, self.backoff * 2)
        else:
            self.backoff = BACKOFF_FIRST


class Speculator:
    def __init__(self, kv: ReqKV, max_seq_len: int, device_type: str) -> None:
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.shared = SharedNgrams()
        self.max_rows = MAX_ROWS.get(device_type, MAX_ROWS["cuda"])
        self.max_draft_tokens = MAX_DRAFT_TOKENS.get(device_type, MAX_DRAFT_TOKENS["cuda"])
        self.states: weakref.WeakKeyDictionary[Req, SpecState] = weakref.WeakKeyDictionary()
        self.drafted = 0  # draft tokens verified, over every request (the Prometheus counters)
        self.accepted = 0
        self.verify_rows = 0  # rows verified with a draft (accepted / verify_rows: the mean accepted length - 1)

    def drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each row's draft for the next step ([] for none); None when no row has one (a plain decode step)."""
        if len(reqs) > self.max_rows:
            return None
        budget = self.max_draft_tokens
        out: list[list[int]] = []
        for req in reqs:
            draft = self._draft(req, budget) if budget > 0 else []
            budget -= len(draft)
            out.append(draft)
        return out if any(out) else None

    def _draft(self, req: Req, budget: int) -> list[int]:
        state = self.states.get(req)
        if state is None:
            state = self.states[req] = SpecState(req.input_ids)
        if state.skip > 0:
            state.skip -= 1
            return []
        p = req.sampling_params
        # Every emitted token must fit max_tokens and the context window: the draft, then the target's own token.
        k = min(state.k, budget, p.max_tokens - req.num_output - 1, self.max_seq_len - req.seq_len - 1)
        if k <= 0 or req.grammar_gate is not None:
            return []
        # A seeded request drafts from its own tokens only: its output must not depend on other requests.
        draft = propose(state.index, self.shared if req.seed is None else None, k)
        stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | req.eos_token_ids
        for i, token in enumerate(draft):
            if token in stops:  # nothing follows a stop token
                draft = draft[: i + 1]
                break
        if req.grammar is not None and draft:
            draft = _grammar_prefix(req.grammar, draft)
        return draft

    def verify_batch(self, batch: Batch, drafts: list[list[int]]) -> tuple[Batch, list[list[int]]]:
        """The decode batch as an extend batch of each row's last token and draft, slots reserved for the drafts (a
        row whose draft finds no pages runs without it)."""
        tokens: list[int] = []
        chosen = []
        kept = []
        for req, draft in zip(batch.reqs, drafts):
            # The decode step reserved position cached_len; the draft goes after it.
            if draft and not self.kv.reserve_after(req, req.cached_len + 1, len(draft)):
                draft = []
            tokens.append(req.input_ids[-1])
            tokens.extend(draft)
            chosen.append((req, 1 + len(draft)))
            kept.append(draft)
        verify = self.kv.make_batch(Phase.PREFILL, chosen, tokens)
        verify.sample_mask = [True] * verify.size
        return verify, kept

    def settle(self, req: Req, drafted: int, accepted: int) -> None:
        """Count a row's verify outcome and adapt its next drafts (its KV: ReqKV.shrink)."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_rows += drafted > 0
        state = self.states.get(req)
        if state is not None:
            state.settle(drafted, accepted)

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
