"""The prefill budget: how much prompt one step may compute while other requests are decoding.

A step is one forward, prefill or decode, never both (scheduler.py). With nothing decoding, a prefill step takes up
to max_prefill_tokens: only throughput matters then. With requests decoding, each of them waits between two tokens
for the prefill steps run since the last decode step plus one decode step; the budget keeps that wait under
max_decode_gap. A prefill step gets the prompt tokens predicted to fit in what is left of the gap once the next
decode step is set aside; when nothing fits, the decode step runs first and the gap starts over. Prefill steps thus
run back to back while they are short (a burst of small prompts), and alternate with decode steps when a long prompt
is chunked. The first prefill step after a decode step computes at least MIN_CHUNK tokens, so a prompt makes progress
even where one token costs more than the gap.

Prediction. A prefill step is modelled as f + a * tokens + c * pairs: f a fixed cost per step (launches, a backend's
planning), pairs the attention's query-key pairs, sum of extend * (prefix + (extend + 1) / 2) over its requests (the
part that grows with the prefix a chunk reads). f, a and c are fitted by exponentially weighted least squares of the
relative error over recent prefill steps (a chunk beside decodes weighs as much as a full step before it), pulled
weakly towards f = 0 and the model's ratio of a to c in FLOPs, which decide what the steps cannot tell apart (steps
of one size, one prefix). The decode step's time is an EMA.
Before any prefill step was measured, a step beside decodes computes MIN_CHUNK tokens and a decode step follows.

Timing adds no wait for the device. On the host (CPU) a step computes its forward before it ends, whether or not
overlap scheduling is on, so one clock read per step end gives each launched batch its time, since the previous step
ended. On CUDA the host reads a step's tokens one step later (overlap, scheduler.py), and some launches wait for the
device themselves (a backend or layer that reads a result on the host): host clocks would credit a wait to the wrong
step. There each step records a timing event after its forward (step.py), and a batch's time is the device time from
the previous batch's event to its own, read once both are done (the device's idle wait for the host included). After
an idle loop (no work left at a step's end) the time starts again with the next step.

Tensor parallelism: every rank must build the same batches, and measured times differ between ranks. The state that
decides (the fit, the decode time, the gap spent) is state(), a tuple of floats: rank 0 measures and sends it with
each step's ops when it changed, the other ranks load() it before the same step and measure nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
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


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m x = v by Gaussian elimination with partial pivoting (m small and symmetric); None when singular."""
    size = len(v)
    rows = [m[i][:] + [v[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            f = rows[r][col] / rows[col][col]
            rows[r] = [x - f * y for x, y in zip(rows[r], rows[col])]
    x = [0.0] * size
    for r in reversed(range(size)):
        x[r] = (rows[r][size] - sum(rows[r][k] * x[k] for k in range(r + 1, size))) / rows[r][r]
    return x


class StepCost:
    """The fitted cost of a prefill step: f seconds per step, a per token, c per query-key pair (a is None until
    measured)."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio  # pairs per token's worth, the prior
        # Exponentially weighted sums over recent prefill steps of the products of x = (1, tokens, pairs) / seconds
        # (each step relative to its own time: a small chunk's counts as much as a full step's), and x itself.
        self.sums = [0.0] * 9  # 11, 1n, 1p, nn, np, pp, 1, n, p
        self.f = self.c = 0.0
        self.a: float | None = None

    def observe(self, tokens: float, pairs: float, seconds: float) -> None:
        if seconds <= 0:
            return
        one, n, p = 1 / seconds, tokens / seconds, pairs / seconds
        s = self.sums
        for i, v in enumerate((one * one, one * n, one * p, n * n, n * p, p * p, one, n, p)):
            s[i] = DECAY * s[i] + v
        self.refit()

    def refit(self) -> None:
        """Least squares of seconds ~ f + a*tokens + c*pairs in relative error, pulled weakly towards f = 0 and
        a = k*c (what the data cannot tell apart follows the prior); a negative cost falls back to fewer terms."""
        s11, s1n, s1p, snn, snp, spp, v1, vn, vp = self.sums
        if snn <= 0:
            self.f, self.a, self.c = 0.0, None, 0.0
            return
        k, mu_f, mu = self.ratio, PRIOR_WEIGHT * s11, PRIOR_WEIGHT * snn
        full = _solve(
            [[s11 + mu_f, s1n, s1p], [s1n, snn + mu, snp - mu * k], [s1p, snp - mu * k, spp + mu * k * k]], [v1, vn, vp]
        )
        if full is not None and min(full) >= 0:
            self.f, self.a, self.c = full
            return
        pair = _solve([[snn + mu, snp - mu * k], [snp - mu * k, spp + mu * k * k]], [vn, vp])
        if pair is not None and min(pair) >= 0:
            self.f, (self.a, self.c) = 0.0, pair
            return
        rate = max(0.0, (vn + vp / k) / (snn + 2 * snp / k + spp / (k * k)))  # one rate along the prior's shape
        self.f, self.a, self.c = 0.0, rate, rate / k

    def seconds(self, extend: int, prefix: int) -> float:
        if self.a is None:
            return math.inf
        return self.f + self.a * extend + self.c * extend * (prefix + (extend + 1) / 2)

    def tokens_within(self, seconds: float, prefix: int) -> int:
        """The most tokens after `prefix` cached ones that one step computes in `seconds`."""
        if self.a is None:
            return 0
        seconds -= self.f
        if seconds <= 0:
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
        self._busy = False  # the last step left work: the loop did not idle since
        self._started = False  # step_started() ran for the step in progress
        self._host_timed = True  # until a device event arrives
        self._last_end: float | None = None  # host clock at the last step's end
        self._pending: deque[tuple[Batch, Any]] = deque()  # launched batches whose device events are not done yet
        self._last_event: Any = None

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
        if batch.is_decode or batch.is_verify:
            self.spent_s = 0.0
        elif allowance is not None and allowance.seconds is not None:
            self.spent_s += allowance.used_s if self.cost.a is not None else self.max_gap

    def step_started(self) -> None:
        """The start of a step; after an idle loop the host clock starts here (an idle wait is no step's time).
        Once per step: a tensor-parallel rank 0 calls it before it sends its state, and the step's own call is then
        a no-op, so the state it decides with is the one it sent."""
        if self._started:
            return
        self._started = True
        if not self._busy:
            self._drain()  # every event is done when the loop goes idle
            self._last_event = None
            self._last_end = self.clock() if self._host_timed else None

    def step_done(self, launched: Batch | None, event: Any, busy: bool) -> None:
        """The end of a step: `launched` its batch (None: none), `event` the device event recorded after it (None:
        the forward ran on the host, done by now); busy: work is left, so the next step starts at once."""
        self._busy, self._started = busy, False
        if self.following:
            return
        if event is None:  # the host computed the forward within this step: the step's time is the batch's
            now = self.clock()
            if launched is not None and self._last_end is not None:
                self._observe(launched, now - self._last_end)
            self._last_end = now
            return
        self._host_timed = False
        if launched is not None:
            self._pending.append((launched, event))
        self._drain()

    def _drain(self) -> None:
        """Time the launched batches whose events are done, in order: each from the previous one's event to its
        own, which counts what the device waited for the host too. query() and elapsed_time() of done events do not
        wait for the device."""
        while self._pending and self._pending[0][1].query():
            batch, event = self._pending.popleft()
            if self._last_event is not None:
                self._observe(batch, self._last_event.elapsed_time(event) / 1e3)
            self._last_event = event

    def _observe(self, batch: Batch, seconds: float) -> None:
        if batch.is_decode or batch.is_verify:  # a verify step decodes its rows (speculative decoding)
            self.decode_s = seconds if self.decode_s == 0 else self.decode_s + DECODE_ALPHA * (seconds - self.decode_s)
            return
        tokens = pairs = 0.0
        for prefix, extend in zip(batch.prefix_lens, batch.extend_lens):
            tokens += extend
            pairs += extend * (prefix + (extend + 1) / 2)
        self.cost.observe(tokens, pairs, seconds)

    # -- tensor parallelism: rank 0's deciding state, carried to the other ranks

    def state(self) -> tuple[float, ...]:
        """Everything allowance() and scheduled() read, as floats (the ops' codec carries them)."""
        return (self.max_gap, self.decode_s, self.spent_s, *self.cost.sums)

    def load(self, state: Sequence[float]) -> None:
        """Take rank 0's state(); from now on this rank follows it and measures nothing."""
        self.following = True
        self.max_gap, self.decode_s, self.spent_s = (float(v) for v in state[:3])
        self.cost.sums = [float(v) for v in state[3:]]
        self.cost.refit()
