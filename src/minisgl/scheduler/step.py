"""A step on the device: its tokens copied to the host without waiting, read once ready; the warm-up step."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, NamedTuple

import torch

from minisgl import plugins
from minisgl.config import EngineConfig
from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.errors import EngineError
from minisgl.scheduler.kv import ReqKV


class LaunchedStep(NamedTuple):
    """A forward + sampling already queued on the device; its tokens are read by Scheduler._process."""

    batch: Batch
    sampled: list[Req]  # requests that get a token from this step, in row order
    tokens: torch.Tensor | None  # [len(sampled)] int64 on the host (pinned on CUDA), valid once `ready` fires
    logprobs: list[Any] | None
    # A timing torch.cuda.Event recorded after the forward and the device-to-host copy (on CUDA, tokens or not), or None
    ready: Any
    sampled_ids: frozenset[int]  # id() of the sampled requests: their last token is not on the host yet


def copy_to_host(
    kv: ReqKV, batch: Batch, sampled: list[Req], next_ids: torch.Tensor | None, logprobs: Any
) -> LaunchedStep:
    """Start the device-to-host copy of the sampled tokens; keep them on the device as their rows' last tokens.

    On CUDA the step's event also times it (budget.py reads the time between two steps' events once both are done)."""
    tokens = None
    if next_ids is not None:
        for req in sampled:
            req.tokens_in_flight += 1
        rows = torch.tensor([r.table_idx for r in sampled], dtype=torch.int64).to(kv.device, non_blocking=True)
        kv.last_tokens.index_copy_(0, rows, next_ids)
        if next_ids.is_cuda:
            tokens = torch.empty(next_ids.shape, dtype=torch.int64, pin_memory=True)
            tokens.copy_(next_ids, non_blocking=True)
        else:
            tokens = next_ids
    ready = None
    if kv.device.type == "cuda":
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
    return LaunchedStep(batch, sampled, tokens, logprobs, ready, frozenset(map(id, sampled)))


def launch_observed(launch: Callable[[Batch], LaunchedStep], batch: Batch, started: float) -> LaunchedStep:
    """launch(batch) between the minisgl_step_scheduled and minisgl_step_launched hooks (hooks.py).

    started: time.perf_counter() when the scheduler began choosing the batch. Only called when a plugin implements
    one of the two hooks; an observer's exception is logged, never fails the step.
    """
    hook = plugins.get_plugin_manager().hook
    _observe(hook.minisgl_step_scheduled, batch=batch, schedule_s=time.perf_counter() - started)
    t0 = time.perf_counter()
    launched = launch(batch)
    _observe(hook.minisgl_step_launched, batch=batch, launch_s=time.perf_counter() - t0)
    return launched


def _observe(hook: Any, **kwargs: Any) -> None:
    try:
        hook(**kwargs)
    except Exception:  # noqa: BLE001 - an observer's bug must not fail the batch it watches
        logging.getLogger("minisgl").exception("plugin hook %s raised", hook.name)


def read_tokens(step: LaunchedStep) -> list[int] | None:
    """The step's sampled tokens on the host (waits for the copy); None when nothing was sampled."""
    if step.tokens is None:
        return None
    if step.ready is not None:
        step.ready.synchronize()
    return step.tokens.tolist()


# Warm-up prompts span this many pages and one more each: CUDA loads a kernel when it first runs (lazy module
# loading, PyTorch's default), and some kernels have a variant for small inputs (index_select over at most 16
# indices); a warm-up of 1-token prompts left the first real prefill over more pages to load the others, 15-35 ms of
# host time with the GPU idle on one H100.
WARMUP_PAGES = 16


@torch.inference_mode()
def warmup(config: EngineConfig, engine: Any, kv: ReqKV, eos_token_ids: frozenset[int]) -> None:
    """A prefill of two prompts in one batch, then a decode step of both, outside the books, before anything is served.

    A dtype or kernel this machine cannot run then fails the start-up with a clear error instead of the first
    request. The prompts are shorter where the pool, the prefill budget or the context window is small (down to one
    1-token prompt). Nothing is cached; every page and row is given back.
    """
    ps = kv.page_size
    length = WARMUP_PAGES * ps + 1
    # Each prompt and its one decoded token in at most half the pool; both prompts in one prefill batch.
    length = min(
        length, (kv.cache.available_pages // 2) * ps - 1, config.max_prefill_tokens // 2, engine.max_seq_len - 1
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    reqs: list[Req] = []
    reserved: list[int] = []  # positions with slots past cached_len, per request
    try:
        for n in [length, length] if length >= 1 else [1]:
            req = Req(
                rid="warmup", input_ids=[0] * n, sampling_params=params, prompt_len=n, eos_token_ids=eos_token_ids
            )
            if not kv.admit(req):
                break
            assert req.matched_len == 0, "the prefix cache is empty at start-up"
            reqs.append(req)
            reserved.append(0)
        for phase in (Phase.PREFILL, Phase.DECODE):
            chosen = []
            for i, req in enumerate(reqs):
                extend = req.seq_len - req.cached_len
                if not kv.reserve(req, extend):
                    break  # a pool too small for two tokens still serves one-token requests
                reserved[i] = extend
                chosen.append((req, extend))
            if not reqs or len(chosen) < len(reqs):
                break
            next_ids = engine.forward_and_sample(kv.make_batch(phase, chosen), reqs).next_ids
            assert next_ids is not None
            for i, req in enumerate(reqs):
                kv.last_tokens[req.table_idx] = next_ids[i]
                req.cached_len, reserved[i] = req.seq_len, 0
                req.input_ids.append(int(next_ids[i]))
    except Exception as e:
        what = f"{config.model} in {str(engine.dtype).removeprefix('torch.')} on {engine.device}"
        raise EngineError(
            f"{what} cannot run on this machine: a test forward pass failed with {type(e).__name__}: {e}. "
            "Pick another --dtype (float32 runs on every CPU) or --device"
        ) from e
    finally:
        for req, extra in zip(reqs, reserved):
            row = kv.page_table[req.table_idx]
            kv.cache.release(req.input_ids, row, 0, 0, req.cache_handle, alloc_len=req.cached_len + extra)
            kv.table.free(req.table_idx)
