"""Verification of draft tokens: the target's choice at every drafted position of a row, in one pass over its logits.

A row with a draft computed its last sampled token followed by the draft's k tokens; position j's logits predict the
token after draft[:j]. Each position is processed as the request would be had draft[:j] been sampled already
(penalties, min_tokens, the grammar's mask; `Position`). Greedy: the longest draft prefix equal to the argmax is
accepted, then the argmax after it. Sampling: the speculative-sampling rule for a deterministic draft, by coupling:
each position draws its token as plain sampling does (argmax of p / Exp(1) noise, p the final distribution after
temperature, top-k/top-p/min-p, penalties and logit_bias), and draft token x is accepted when the draw is x. That
happens with probability p(x), and a rejected position's draw is distributed as p with x removed, renormalised: the
rule's two steps. Every emitted token is a plain sample; a seeded request's generator is rewound to the draws of the
emitted tokens, so its output is the same with speculation as without.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.sampler import (
    SamplingInfo,
    _filter_probs,
    compute_logprobs,
    processed_logits,
)


class Position:
    """A request seen from one drafted position: its tokens as if draft[:j] had been sampled (what the sampler's
    penalties and min_tokens read), its grammar and generator the request's own."""

    __slots__ = ("req", "extra", "sampling_params", "eos_token_ids", "grammar", "generator", "states")

    def __init__(self, req: Any, extra: list[int]) -> None:
        self.req, self.extra = req, extra
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.grammar = req.grammar
        self.generator = req.generator
        self.states: list[torch.Tensor] | None = None  # a seeded row's generator states after each draw (verify)

    @property
    def input_ids(self) -> list[int]:
        return self.req.input_ids + self.extra if self.extra else self.req.input_ids

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids + self.extra if self.extra else self.req.output_ids

    @property
    def num_sampled(self) -> int:
        return self.req.num_sampled + len(self.extra)


class Verified(NamedTuple):
    """A row's outcome: the tokens to emit (the accepted draft prefix, then the target's own token) and their
    logprobs (None when the request asked for none)."""

    tokens: list[int]
    logprobs: list[Any] | None
    accepted: int  # draft tokens accepted


def positions(reqs: Sequence[Any], drafts: Sequence[list[int]]) -> list[Position]:
    """Every scored position, row by row: len(draft) + 1 for each request."""
    return [Position(req, draft[:j]) for req, draft in zip(reqs, drafts) for j in range(len(draft) + 1)]


def grammar_masks(rows: list[Position], drafts: Sequence[list[int]], apply: Callable[[Any, list[Any]], None]) -> Any:
    """A function masking the logits of `rows` by the grammars, each position by the state after its draft prefix;
    None when no request has a grammar. The drafts were checked against the grammars before (every token accepted)."""
    if not any(p.grammar is not None for p in rows):
        return None

    def mask(logits: torch.Tensor) -> None:
        i = 0
        for draft in drafts:
            state = rows[i].grammar
            if state is None:
                i += len(draft) + 1
                continue
            for j in range(len(draft) + 1):
                apply(logits[i + j : i + j + 1], [state])
                if j < len(draft):
                    state.accept_token(draft[j])
            state.rollback(len(draft))
            i += len(draft) + 1

    return mask


def verify(
    logits: torch.Tensor,
    rows: list[Position],
    drafts: Sequence[list[int]],
    info: SamplingInfo,
    mask: Any,
    generator: torch.Generator,
) -> list[Verified]:
    """Accept draft prefixes and choose each row's next token; logits [len(rows), vocab], rows from positions()."""
    logits = processed_logits(logits, rows, info, mask)
    starts, i = [], 0
    for draft in drafts:
        starts.append(i)
        i += len(draft) + 1
    chosen = logits.argmax(dim=-1)
    if not info.greedy:
        probs = _filter_probs(torch.softmax(logits / info.temperature, dim=-1), info)
        sampled = (probs / _noise(rows, starts, drafts, probs.shape, generator)).argmax(dim=-1)
        if info.greedy_rows is not None:
            greedy = torch.tensor([rows[i].sampling_params.greedy for i in range(len(rows))], device=logits.device)
            sampled = torch.where(greedy, chosen, sampled)
        chosen = sampled
    targets = chosen.tolist()
    emitted: list[list[int]] = []
    for start, draft in zip(starts, drafts):
        a = 0
        while a < len(draft) and targets[start + a] == draft[a]:
            a += 1
        emitted.append(draft[:a] + [targets[start + a]])
    _rewind_seeded(rows, starts, emitted)
    logprobs = _logprobs(logits, rows, starts, emitted, info)
    return [Verified(tokens, lps, len(tokens) - 1) for tokens, lps in zip(emitted, logprobs)]


def _noise(
    rows: list[Position], starts: list[int], drafts: Sequence[list[int]], shape: Any, generator: torch.Generator
) -> torch.Tensor:
    """Exp(1) noise per position, as the plain sampler draws it: unseeded rows from the engine's stream; a seeded
    row's positions one vocabulary-sized draw each from its own generator, in order, each draw's generator state
    kept (Position.states) so that only the emitted tokens' draws count (_rewind_seeded)."""
    noise = torch.empty(shape, device=generator.device).exponential_(generator=generator)
    for start, draft in zip(starts, drafts):
        gen = rows[start].generator
        if gen is None:
            continue
        rows[start].states = []
        for j in range(len(draft) + 1):
            noise[start + j].exponential_(generator=gen)
            rows[start].states.append(gen.get_state())
    return noise


def _rewind_seeded(rows: list[Position], starts: list[int], emitted: list[list[int]]) -> None:
    """A seeded row's generator as if it had drawn for its emitted tokens only: the same draws plain decoding makes
    for them, so a seeded request's output does not depend on its drafts."""
    for start, tokens in zip(starts, emitted):
        states = rows[start].states
        if states is not None:
            rows[start].generator.set_state(states[len(tokens) - 1])


def _logprobs(
    logits: torch.Tensor, rows: list[Position], starts: list[int], emitted: list[list[int]], info: SamplingInfo
) -> list[list[Any] | None]:
    """Per row, the logprob entries of its emitted tokens (as the plain sampler reports them), or None."""
    if info.logprobs_k < 0:
        return [None] * len(starts)
    index = [s + j for s, tokens in zip(starts, emitted) for j in range(len(tokens))]
    ids = torch.tensor([t for tokens in emitted for t in tokens], dtype=torch.int64, device=logits.device)
    picked = logits[torch.tensor(index, device=logits.device)]
    entries = compute_logprobs(picked, ids, [rows[i] for i in index], info.logprobs_k)
    out: list[list[Any] | None] = []
    k = 0
    for s, tokens in zip(starts, emitted):
        want = rows[s].sampling_params.logprobs is not None
        out.append(entries[k : k + len(tokens)] if want else None)
        k += len(tokens)
    return out


def decode_rows(batch: Batch) -> Batch:
    """An extend batch as a decode batch of one row per token: the row of a request's token at position p reads the
    request's page-table row up to p. Its KV before p is cached or written by the same layer's store, which runs
    before its attention reads, so every row sees what the extend path's causal mask shows it."""
    reqs: list[Any] = []
    prefix_lens: list[int] = []
    for req, start, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        reqs.extend([req] * extend)
        prefix_lens.extend(range(start, start + extend))
    tokens = len(reqs)
    # The rows on the host (one copy), not repeat_interleave on the device: ~50 us of host time per call on CUDA.
    table_rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    table_rows = table_rows.to(batch.out_loc.device, non_blocking=True)
    return Batch(
        reqs=reqs,
        phase=Phase.DECODE,
        input_ids=batch.input_ids,
        positions=batch.positions,
        out_loc=batch.out_loc,
        table_rows=table_rows,
        prefix_lens=prefix_lens,
        extend_lens=[1] * tokens,
        seq_lens=[p + 1 for p in prefix_lens],
        sample_mask=[True] * tokens,
    )
