"""The prefill budget: how much prompt one step may compute while other requests are decoding.

A step is one forward, prefill or decode, never both (scheduler.py). With nothing decoding, a prefill step takes up
to max_prefill_tokens: only throughput matters then. With requests decoding, each of them waits between two tokens
for the prefill steps run since the last decode step plus one decode step; the budget keeps that wait under
max_decode_gap. A prefill step gets the prompt tokens predicted to fit in what is left of the gap once the next
decode step is set aside; when nothing fits, the decode step runs first and the gap starts over. Prefill steps thus
run back to back while they are short (a burst of small prompts), and alternate with decode steps when a long prompt
is chunked. The first prefill step after a decode step computes at least MIN_CHUNK tokens, so a prompt makes progress
even where one token costs more than the gap.

Prediction. A prefill step is modelled as a * tokens + c * pairs, where pairs counts the attention's query-key pairs,
sum of extend * (prefix + (extend + 1) / 2) over its requests: the part that grows with the prefix a chunk reads. a
and c are fitted by exponentially weighted least squares over recent prefill steps, pulled weakly towards the
model's ratio of the two costs in FLOPs (which holds them apart until the steps' prefixes differ); a fixed cost of a
step is folded into a, which the fit measures at the chunk sizes the gap leads to. The decode step's time is an EMA.
Before any prefill step was measured, a step beside decodes computes MIN_CHUNK tokens and a decode step follows.

Timing costs one clock read per step, at its end, and no wait for the device: the time between two step ends is what
a decoding request waits per step. Without overlap it covers the step just launched; with overlap (scheduler.py) the
host waits at the end of a step for the forward launched one step earlier, so the interval is that forward's, and
is credited to it. After an idle loop (no work at the previous step's end) the interval starts with the step.

Tensor parallelism: every rank must build the same batches, and measured times differ between ranks. The state that
decides (the fit, the decode time, the gap spent) is state(), a tuple of floats: rank 0 measures and sends it with
each step's ops when it changed, the other ranks load() it before the same step and measure nothing.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from minisgl.core import Batch

# Tokens the first prefill step after a decode step may always compute, and the smallest chunk worth a step beside
# decodes (rounded up to whole pages).
MIN_CHUNK = 32
# Weight of the previous prefill steps in the fit after each new one (about the last four count).
DECAY = 0.75
# Weight of the newest decode step in the decode time's EMA.
DECODE_ALPHA = 0.25
# Strength of the pull towards the FLOP ratio, relative to the data's own weight.
PRIOR_WEIGHT = 0.001
# Default gap by device: a CPU forward is slow whatever its size, a GPU user expects a steady stream.
DEFAULT_GAP_S = {"cpu": 1.0, "cuda": 0.1}


def default_gap(max_decode_gap: float | None, device_type: str) -> float:
    """The gap a config asks for on a device (None: the device's default; 0: unbounded)."""
    if max_decode_gap is not None:
        return float(max_decode_gap)
    return DEFAULT_GAP_S.get(device_type, DEFAULT_GAP_S["cuda"])


def flop_ratio(model_config: Any) -> float:
    """Query-key pairs that cost as much as one token through the linear layers, in FLOPs, for one layer: a token
    costs 2 FLOPs per weight, a pair 4 per query head dimension (the scores and the weighted values)."""
    cfg = model_config
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = cfg.num_experts_per_tok * cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size
    mlp += cfg.shared_expert_intermediate_size
    weights = cfg.hidden_size * (2 * q_dim + 2 * kv_dim + 3 * mlp)
    return max(1.0, 2 * weights / (4 * q_dim))


class StepCost:
    """The fitted cost of a prefill step: a seconds per token, c per query-key pair (None until measured)."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio  # pairs per token's worth, the prior
        # Exponentially weighted sums of tokens (n), pairs (p) and seconds (t) products over recent prefill steps.
        self.sums = [0.0] * 5  # nn, np, pp, nt, pt
        self.a: float | None = None
        self.c = 0.0

    def observe(self, tokens: float, pairs: float, seconds: float) -> None:
        s = self.sums
        for i, v in enumerate((tokens * tokens, tokens * pairs, pairs * pairs, tokens * seconds, pairs * seconds)):
            s[i] = DECAY * s[i] + v
        self.refit()

    def refit(self) -> None:
        nn, np_, pp, nt, pt = self.sums
        if nn <= 0:
            self.a, self.c = None, 0.0
            return
        k, mu = self.ratio, PRIOR_WEIGHT * nn
        # Least squares of seconds ~ a*tokens + c*pairs, plus mu * (a - k*c)^2 (c = a/k when pairs cannot tell).
        m11, m12, m22 = nn + mu, np_ - mu * k, pp + mu * k * k
        det = m11 * m22 - m12 * m12
        a = (nt * m22 - pt * m12) / det if det > 0 else -1.0
        c = (pt * m11 - nt * m12) / det if det > 0 else -1.0
        if a < 0 or c < 0:  # the data contradict the shape: one rate along the prior's
            ww = nn + 2 * np_ / k + pp / (k * k)
            a = max(0.0, (nt + pt / k) / ww)
            c = a / k
        self.a, self.c = a, c

    def seconds(self, extend: int, prefix: int) -> float:
        if self.a is None:
            return math.inf
        return self.a * extend + self.c * extend * (prefix + (extend + 1) / 2)

    def tokens_within(self, seconds: float, prefix: int) -> int:
        """The most tokens after `prefix` cached ones that one step computes in `seconds`."""
        if self.a is None or seconds <= 0:
            return 0
        a, c = self.a, self.c
        if c <= 0:
            return int(seconds / a) if a > 0 else 1 << 40
        b = a + c * (prefix + 0.5)  # c/2 n^2 + b n <= seconds
        return int((-b + math.sqrt(b * b + 2 * c * seconds)) / c)


class Allowance:
    """One prefill step's budget: tokens (max_prefill_tokens) and, beside decodes, predicted seconds."""

    def __init__(
        self, tokens: int, seconds: float | None, cost: StepCost, floor: int, min_chunk: int, page_size: int
    ) -> None:
        self.tokens = tokens
        self.seconds = seconds  # None: no time bound (nothing is decoding)
        self.cost = cost
        self.floor = floor  # tokens granted whatever they cost to the first request taken (0: none)
        self.min_chunk = min_chunk  # a smaller chunk is not worth a step: the decode step runs first
        self.page_size = page_size
        self.used_s = 0.0
        self.taken = 0

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or (self.seconds is not None and self.taken > 0 and self.seconds <= 0)

    def fit(self, prefix: int, want: int) -> int:
        """Tokens of a request with `prefix` cached and `want` left that this step can still compute (0: none)."""
        n = min(want, self.tokens)
        if self.seconds is None or n <= 0:
            return max(n, 0)
        fits = self.cost.tokens_within(self.seconds, prefix)
        if self.taken == 0:
            fits = max(fits, self.floor)
        if fits >= n:
            return n
        if fits < self.min_chunk:
            return 0
        return fits - (prefix + fits) % self.page_size  # the chunk ends on a page boundary: whole pages are cached

    def take(self, prefix: int, n: int, want: int) -> None:
        """Grant n of a request's `want` tokens; a chunk (n < want) ends the step: one prompt at a time is chunked."""
        self.tokens = self.tokens - n if n >= want else 0
        self.taken += n
        if self.seconds is not None:
            spent = self.cost.seconds(n, prefix)
            self.seconds -= spent
            self.used_s += spent


class PrefillBudget:
    """Sizes each prefill step so that decoding requests keep their gap between tokens (see the module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        max_gap: float,
        page_size: int,
        ratio: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.max_tokens = max_tokens
        self.max_gap = max_gap  # seconds; 0: prefill steps are not bounded in time
        self.page_size = page_size
        self.min_chunk = -(-MIN_CHUNK // page_size) * page_size
        self.cost = StepCost(ratio)
        self.decode_s = 0.0  # EMA of a decode step's time
        self.spent_s = 0.0  # predicted prefill seconds since the last decode step
        self.following = False  # a tensor-parallel rank > 0: rank 0's state, loaded each step, decides
        self._last_end: float | None = None

    def allowance(self, decoding: bool, after_decode: bool = False) -> Allowance | None:
        """The next prefill step's budget; None: a decode step must run first. decoding: requests are decoding now.
        after_decode: treat the gap as fresh (no decode step can run now, the decodes' last tokens being in flight)."""
        if not decoding or self.max_gap <= 0:
            self.spent_s = 0.0
            return Allowance(self.max_tokens, None, self.cost, 0, 0, self.page_size)
        spent = 0.0 if after_decode else self.spent_s
        left = self.max_gap - self.decode_s - spent
        if spent > 0 and (left <= 0 or self.cost.a is None):
            return None
        floor = self.min_chunk if spent == 0 else 0
        return Allowance(self.max_tokens, max(left, 0.0), self.cost, floor, self.min_chunk, self.page_size)

    def scheduled(self, batch: Batch | None, allowance: Allowance | None) -> None:
        """Account the step about to launch: a decode step starts the gap over, a prefill step beside decodes uses
        some of it (all of it while nothing was measured yet)."""
        if batch is None:
            return
        if batch.is_decode:
            self.spent_s = 0.0
        elif allowance is not None and allowance.seconds is not None:
            self.spent_s += allowance.used_s if self.cost.a is not None else self.max_gap

    def step_started(self) -> None:
        """The start of a step after an idle loop (the clock's only other read): its time is a sample too."""
        if self._last_end is None:
            self._last_end = self.clock()

    def step_done(self, completed: Batch | None, busy: bool) -> None:
        """The end of a step: `completed` is the batch whose forward it waited for (None: none); busy: work is left,
        so the loop starts the next step at once and the time until its end is a sample."""
        now = self.clock()
        last, self._last_end = self._last_end, (now if busy else None)
        if completed is None or last is None or self.following:
            return
        elapsed = now - last
        if completed.is_decode:
            self.decode_s = elapsed if self.decode_s == 0 else self.decode_s + DECODE_ALPHA * (elapsed - self.decode_s)
            return
        tokens = pairs = 0.0
        for prefix, extend in zip(completed.prefix_lens, completed.extend_lens):
            tokens += extend
            pairs += extend * (prefix + (extend + 1) / 2)
        self.cost.observe(tokens, pairs, elapsed)

    # -- tensor parallelism: rank 0's deciding state, carried to the other ranks

    def state(self) -> tuple[float, ...]:
        """Everything allowance() and scheduled() read, as floats (the ops' codec carries them)."""
        return (self.max_gap, self.decode_s, self.spent_s, *self.cost.sums)

    def load(self, state: Sequence[float]) -> None:
        """Take rank 0's state(); from now on this rank follows it and measures nothing."""
        self.following = True
        self.max_gap, self.decode_s, self.spent_s = (float(v) for v in state[:3])
        self.cost.sums = [float(v) for v in state[3:8]]
        self.cost.refit()
