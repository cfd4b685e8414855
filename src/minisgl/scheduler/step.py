"""A step on the device: its tokens copied to the host without waiting, read once ready; the warm-up step."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

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
    ready: Any  # torch.cuda.Event recorded after the device-to-host copy, or None
    sampled_ids: frozenset[int]  # id() of the sampled requests: their last token is not on the host yet


def copy_to_host(kv: ReqKV, batch: Batch, sampled: list[Req], next_ids: torch.Tensor | None, logprobs: Any) -> LaunchedStep:
    """Start the device-to-host copy of the sampled tokens; keep them on the device as their rows' last tokens."""
    tokens = ready = None
    if next_ids is not None:
        for req in sampled:
            req.tokens_in_flight += 1
        rows = torch.tensor([r.table_idx for r in sampled], dtype=torch.int64).to(kv.device, non_blocking=True)
        kv.last_tokens.index_copy_(0, rows, next_ids)
        if next_ids.is_cuda:
            tokens = torch.empty(next_ids.shape, dtype=torch.int64, pin_memory=True)
            tokens.copy_(next_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            tokens = next_ids
    return LaunchedStep(batch, sampled, tokens, logprobs, ready, frozenset(map(id, sampled)))


def read_tokens(step: LaunchedStep) -> list[int] | None:
    """The step's sampled tokens on the host (waits for the copy); None when nothing was sampled."""
    if step.tokens is None:
        return None
    if step.ready is not None:
        step.ready.synchronize()
    return step.tokens.tolist()


@torch.inference_mode()
def warmup(config: EngineConfig, engine: Any, kv: ReqKV, eos_token_ids: frozenset[int]) -> None:
    """One prefill and one decode of a 1-token prompt, outside the books, before anything is served.

    A dtype or kernel this machine cannot run then fails the start-up with a clear error
    instead of the first request. Nothing is cached; every page and row is given back.
    """
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    req = Req(rid="warmup", input_ids=[0], sampling_params=params, prompt_len=1, eos_token_ids=eos_token_ids)
    if not kv.admit(req):
        return
    assert req.matched_len == 0, "the prefix cache is empty at start-up"
    reserved = 0
    try:
        for phase in (Phase.PREFILL, Phase.DECODE):
            if not kv.reserve(req, 1):
                break  # a pool too small for two tokens still serves one-token requests
            reserved = 1
            next_ids, *_ = engine.forward_and_sample(kv.make_batch(phase, [(req, 1)]), [req])
            assert next_ids is not None
            kv.last_tokens[req.table_idx] = next_ids[0]
            req.cached_len, reserved = req.cached_len + 1, 0
            req.input_ids.append(int(next_ids[0]))
    except Exception as e:
        what = f"{config.model} in {str(engine.dtype).removeprefix('torch.')} on {engine.device}"
        raise EngineError(
            f"{what} cannot run on this machine: a test forward pass failed with {type(e).__name__}: {e}. "
            "Pick another --dtype (float32 runs on every CPU) or --device"
        ) from e
    finally:
        row = kv.page_table[req.table_idx]
        kv.cache.release(req.input_ids, row, 0, 0, req.cache_handle, alloc_len=req.cached_len + reserved)
        kv.table.free(req.table_idx)
