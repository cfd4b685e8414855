"""The one place that turns SamplingParams into tensors, and samples the next tokens of a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minisgl.core import Req


@dataclass
class SamplingInfo:
    """Per-batch sampling tensors, built once per batch from the requests' params."""

    greedy: bool  # every row greedy: argmax only
    temperature: torch.Tensor  # [B, 1]
    top_k: torch.Tensor | None  # [B] (vocab size where off), None when no row uses it
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    greedy_rows: torch.Tensor | None  # [B] bool
    penalties: bool
    logprobs_k: int  # max top-k alternatives requested in the batch; -1 when no row wants logprobs
    min_tokens: bool = False  # some row may not stop yet
    logit_bias: bool = False  # some row has a logit_bias
    temperatures: list[float] | None = None  # per row on the host (0.0 for greedy rows), for in-graph sampling
    in_graph: bool = False  # a decode graph samples the batch itself: no device tensors were made

    @classmethod
    def from_reqs(cls, reqs: list["Req"], vocab_size: int, device: torch.device, graph: bool = False) -> "SamplingInfo":
        """graph=True: the batch runs a decode graph that can sample (engine/gumbel.py); when its rows need only
        temperatures (no top-k/top-p/min-p, penalties, logit_bias, min_tokens, logprobs or seeded generator),
        the info is host-only (in_graph, with `temperatures`) and the caller leaves the sampling to the graph."""
        params = [r.sampling_params for r in reqs]
        greedy_flags = [p.greedy for p in params]
        logprobs_k = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        penalties = any(p.has_penalties for p in params)
        min_tokens = any(r.num_sampled < r.sampling_params.min_tokens for r in reqs)
        bias = any(p.logit_bias for p in params)
        filters = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        if (
            graph
            and not (filters or penalties or min_tokens or bias or logprobs_k >= 0)
            and all(r.generator is None for r in reqs)
        ):
            temps = [0.0 if g else p.temperature for p, g in zip(params, greedy_flags)]
            return cls(
                all(greedy_flags), torch.ones(0), None, None, None, None, False, -1, temperatures=temps, in_graph=True
            )
        if all(greedy_flags):
            return cls(True, torch.ones(0), None, None, None, None, penalties, logprobs_k, min_tokens, bias)
        temps = [p.temperature if not g else 1.0 for p, g in zip(params, greedy_flags)]
        temperature = torch.tensor(temps, dtype=torch.float32).view(-1, 1).to(device, non_blocking=True)
        top_k = top_p = min_p = None
        # non_blocking: a blocking host-to-device copy would wait for the GPU (no overlap).
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]).to(device, non_blocking=True)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device, non_blocking=True)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(device, non_blocking=True)
        greedy_rows = torch.tensor(greedy_flags).to(device, non_blocking=True) if any(greedy_flags) else None
        return cls(False, temperature, top_k, top_p, min_p, greedy_rows, penalties, logprobs_k, min_tokens, bias)


def apply_penalties(logits: torch.Tensor, reqs: list["Req"]) -> torch.Tensor:
    """Repetition (HF: over prompt + output), presence and frequency (OpenAI: over output) penalties."""
    B, V = logits.shape
    device = logits.device
    params = [r.sampling_params for r in reqs]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype).to(device, non_blocking=True)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype).to(device, non_blocking=True)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype).to(device, non_blocking=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if r.sampling_params.repetition_penalty != 1.0:
                rows += [i] * len(r.input_ids)
                cols += r.input_ids
        seen = torch.zeros(B * V, dtype=torch.bool, device=device)
        seen = seen.index_fill_(0, _flat_index(rows, cols, V, device), True).view(B, V)
        penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalised, logits)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        rows, cols = [], []
        for i, r in enumerate(reqs):
            rows += [i] * len(r.output_ids)
            cols += r.output_ids
        counts = torch.zeros(B * V, dtype=logits.dtype, device=device)
        if rows:
            flat = _flat_index(rows, cols, V, device)
            counts.index_add_(0, flat, torch.ones(flat.shape, dtype=logits.dtype, device=device))
        counts = counts.view(B, V)
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, reqs: list["Req"]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (one index_add from one non-blocking copy)."""
    rows, cols, values = [], [], []
    for i, r in enumerate(reqs):
        for token, bias in (r.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    B, V = logits.shape
    flat = _flat_index(rows, cols, V, logits.device)
    add = torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True)
    return logits.view(-1).index_add(0, flat, add).view(B, V)


def mask_stops_before_min_tokens(logits: torch.Tensor, reqs: list["Req"]) -> torch.Tensor:
    """Rows that have not reached min_tokens cannot sample EOS or a stop token (a grammar, if any, decides instead).

    One gather, fill and scatter over the batch's stop-token columns, from two small non-blocking
    host copies: nothing here waits for the device (a Python-scalar index assignment would).
    """
    vocab = logits.shape[-1]
    blocked: list[tuple[int, list[int]]] = []
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.num_sampled < p.min_tokens and r.grammar is None:
            stops = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else r.eos_token_ids)) if 0 <= t < vocab]
            if stops:
                blocked.append((i, stops))
    if not blocked:
        return logits
    ids = sorted({t for _, stops in blocked for t in stops})
    column = {t: j for j, t in enumerate(ids)}
    mask = torch.zeros(len(reqs) * len(ids), dtype=torch.bool)
    mask[[i * len(ids) + column[t] for i, stops in blocked for t in stops]] = True
    device = logits.device
    ids_d = torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
    mask_d = mask.view(len(reqs), len(ids)).to(device, non_blocking=True)
    masked = logits.index_select(1, ids_d).masked_fill_(mask_d, float("-inf"))
    return logits.index_copy_(1, ids_d, masked)


def _flat_index(rows: list[int], cols: list[int], width: int, device: torch.device) -> torch.Tensor:
    """rows * width + cols on `device`, from one non-blocking copy (index kernels, never a host wait)."""
    flat = torch.tensor(rows, dtype=torch.int64) * width + torch.tensor(cols, dtype=torch.int64)
    return flat.to(device, non_blocking=True)


# On the CPU, top-k / top-p look at each row's this many most likely tokens (one partial sort, torch.topk) and sort
# the whole vocabulary only when a row's cut may lie beyond them: sorting 32 rows of a 32k vocabulary took ~45 ms.
CANDIDATES = 256


def _filter_probs(probs: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p, row by row (vectorised over the batch)."""
    if info.min_p is not None:
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < info.min_p[:, None] * max_p, 0.0)
    if info.top_k is None and info.top_p is None:
        return probs
    vocab = probs.shape[-1]
    top_k = info.top_k if info.top_k is not None else torch.full(probs.shape[:1], vocab, device=probs.device)
    head = None
    if probs.device.type == "cpu" and vocab > CANDIDATES:
        total = probs.sum(dim=-1)  # a row's mass, top-p's denominator where top-k is off
        head = _candidates(probs, info, top_k, total)
    sorted_probs, order = head if head is not None else probs.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)[None, :]
    drop = ranks >= top_k[:, None]
    if info.top_p is not None:
        # Top-p over the top-k survivors, renormalised (HF / vLLM order); the first token always stays.
        kept = sorted_probs.masked_fill(drop, 0.0)
        norm = torch.where(top_k < vocab, kept.sum(dim=-1), total) if head is not None else kept.sum(dim=-1)
        kept = kept / norm[:, None]
        cum = kept.cumsum(dim=-1)
        drop |= (cum - kept) >= info.top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _candidates(
    probs: torch.Tensor, info: SamplingInfo, top_k: torch.Tensor, total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's CANDIDATES most likely tokens, sorted (values, ids), when every row's top-k / top-p cut lies
    among them; else None (the caller sorts whole rows). A row decides within them when its top-k is at most
    CANDIDATES, or, with top-k off, when they already hold its top-p mass (the next token is then dropped). Greedy
    rows of a mixed batch take their argmax whatever is kept."""
    values, ids = probs.topk(CANDIDATES, dim=-1)
    decided = top_k <= CANDIDATES
    if info.top_p is not None:
        # As _filter_probs computes it, so that the two agree to the last bit: the mass before the next token.
        mass = (values / total[:, None]).cumsum(dim=-1)[:, -1]
        decided |= (top_k >= probs.shape[-1]) & (mass >= info.top_p)
    if info.greedy_rows is not None and info.greedy_rows.shape == decided.shape:
        decided |= info.greedy_rows
    return (values, ids) if bool(decided.all()) else None


def _exponential_noise(
    reqs: list["Req"], shape: tuple[int, int], device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Exp(1) noise for the Gumbel-style argmax(p / q) draw; seeded rows use their own generator,
    so a seeded request draws the same numbers whatever else is in the batch."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for i, r in enumerate(reqs):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    return noise


def compute_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, reqs: list["Req"], k: int) -> list[Any]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, next_ids[:, None]).squeeze(-1).tolist()
    top_vals = top_ids = None
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[Any] = []
    for i, r in enumerate(reqs):
        want = r.sampling_params.logprobs
        if want is None:
            out.append(None)
            continue
        alts = list(zip(top_ids[i][:want], top_vals[i][:want])) if want and top_ids is not None else []
        out.append((chosen[i], alts))
    return out


def token_logprobs(
    compute_logits: Any, hidden: torch.Tensor, targets: torch.Tensor, k: int, block: int = 512
) -> list[Any]:
    """(logprob of targets[i], top-k [(token_id, logprob)]) under the logits of hidden[i], in blocks of rows
    (a long prompt's full-vocabulary logits at once would not fit)."""
    out: list[Any] = []
    for s in range(0, len(targets), block):
        logprobs = torch.log_softmax(compute_logits(hidden[s : s + block]).float(), dim=-1)
        chosen = logprobs.gather(-1, targets[s : s + block, None]).squeeze(-1).tolist()
        if k > 0:
            top = logprobs.topk(k, dim=-1)
            alts = [list(zip(ids, vals)) for ids, vals in zip(top.indices.tolist(), top.values.tolist())]
        else:
            alts = [[] for _ in chosen]
        out += list(zip(chosen, alts))
    return out


def _flashinfer_sampling() -> Any:
    try:
        import flashinfer.sampling
    except ImportError:
        return None
    return flashinfer.sampling


def processed_logits(logits: torch.Tensor, rows: list[Any], info: SamplingInfo, mask: Any) -> torch.Tensor:
    """The logits the sampler draws from, per row (a request, or a verify position): float32, with penalties,
    logit_bias, stops before min_tokens and the grammar mask applied."""
    logits = logits.float()
    if info.penalties:
        logits = apply_penalties(logits, rows)
    if info.logit_bias:
        logits = apply_logit_bias(logits, rows)
    if info.min_tokens:
        logits = mask_stops_before_min_tokens(logits, rows)
    if mask is not None:
        mask(logits)
    return logits


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # GPU fast path: flashinfer's fused sampling kernels for batches without seeded rows or
        # min_p (same distribution as the torch path; seeded rows keep their per-request streams).
        self._fused = _flashinfer_sampling() if self.device.type == "cuda" else None
        # Unseeded rows draw from the engine's own stream: the user's global RNG is left alone,
        # and every TP rank (same seed, same calls) draws the same tokens.
        self._generator = torch.Generator(device=self.device).manual_seed(seed)

    @property
    def generator(self) -> torch.Generator:
        """The engine's own stream (unseeded rows); verification draws from it too (engine/verify.py)."""
        return self._generator

    def _sample_fused(self, logits: torch.Tensor, reqs: list["Req"], info: SamplingInfo) -> torch.Tensor | None:
        if self._fused is None or info.min_p is not None or any(r.generator is not None for r in reqs):
            return None
        scaled = logits / info.temperature
        if info.top_k is None and info.top_p is None:
            ids = self._fused.sampling_from_logits(scaled, generator=self._generator)
        else:
            top_k = info.top_k.to(torch.int32) if info.top_k is not None else self.vocab_size
            top_p = info.top_p if info.top_p is not None else 1.0
            # top_k_first: top-p over the renormalised top-k survivors, as in _filter_probs.
            ids = self._fused.top_k_top_p_sampling_from_logits(
                scaled, top_k, top_p, filter_apply_order="top_k_first", generator=self._generator
            )
        return ids.to(torch.int64)

    def _one_pass(
        self, logits: torch.Tensor, reqs: list["Req"], info: SamplingInfo, bitmask_fn: Any
    ) -> torch.Tensor | None:
        """Next ids from logits in the model's dtype (a CUDA-graph decode's) without a float32 copy first, when
        the batch needs nothing that writes into them (penalties, masks) or reads them whole (logprobs); None
        otherwise. Greedy: argmax (the cast is exact: the same ids). Sampled: the division by the float32
        temperatures gives the float32 logits the fused kernel reads, in the same pass."""
        if info.penalties or info.logit_bias or info.min_tokens or bitmask_fn is not None or info.logprobs_k >= 0:
            return None
        if info.greedy:
            return logits.argmax(dim=-1)
        next_ids = self._sample_fused(logits, reqs, info)
        if next_ids is not None and info.greedy_rows is not None:
            next_ids = torch.where(info.greedy_rows, logits.argmax(dim=-1), next_ids)
        return next_ids

    def sample(
        self, logits: torch.Tensor, reqs: list["Req"], info: SamplingInfo, bitmask_fn: Any = None
    ) -> tuple[torch.Tensor, list[Any] | None]:
        """logits [B, V] -> next token ids [B] (on logits.device) and per-row logprobs (or None)."""
        if logits.dtype != torch.float32:
            next_ids = self._one_pass(logits, reqs, info, bitmask_fn)
            if next_ids is not None:
                return next_ids, None
        logits = logits.float()
        if logits.is_inference() and not torch.is_inference_mode_enabled():
            logits = logits.clone()  # masks below write in place
        logits = processed_logits(logits, reqs, info, bitmask_fn)
        if info.greedy:
            next_ids = logits.argmax(dim=-1)
        else:
            next_ids = self._sample_fused(logits, reqs, info)
            if next_ids is None:
                probs = torch.softmax(logits / info.temperature, dim=-1)
                probs = _filter_probs(probs, info)
                noise = _exponential_noise(reqs, tuple(probs.shape), probs.device, self._generator)
                next_ids = (probs / noise).argmax(dim=-1)
            if info.greedy_rows is not None:
                next_ids = torch.where(info.greedy_rows, logits.argmax(dim=-1), next_ids)
        logprobs = compute_logprobs(logits, next_ids, reqs, info.logprobs_k) if info.logprobs_k >= 0 else None
        return next_ids, logprobs
