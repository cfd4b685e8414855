"""The pluggy hook specification (project name "minisgl").

The architecture and attention backend registries (minisgl.models.registry, minisgl.attention.registry)
hold the built-ins; the plugin loader (minisgl.plugins), which sits above them, adds what the registration
hooks return. Plugins are modules exposed in the "minisgl" entry-point group; each process that needs them
loads them (the engine does, before it looks a model or backend up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from minisgl.core import Batch, Req

PROJECT = "minisgl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def minisgl_register_architectures() -> dict[str, type]:
    """Called once per process when the plugins load (the engine loads them before it builds the model).

    Return a mapping from a HF ``architectures`` name (e.g. "LlamaForCausalLM") to a model
    class constructed as ``cls(model_config)`` (or a "module:Class" reference to one, loaded on
    first use); see minisgl.models.llama for the protocol
    (forward(input_ids, positions) -> hidden, compute_logits(hidden), load_weights(iterable)).
    Later registrations of the same name win (a plugin's replaces a built-in).
    """


@hookspec
def minisgl_register_attention_backends() -> dict[str, Callable[..., Any]]:
    """Called once per process when the plugins load (with minisgl_register_architectures).

    Return a mapping from a backend name (as given to ``--attention-backend``) to a factory
    ``factory(model_config, kv_pool, page_table, device) -> AttentionBackend``.
    """


@hookspec
def minisgl_request_received(req: "Req") -> None:
    """Called by the scheduler for each new sequence, before it is queued.

    Raise a minisgl.errors.InvalidRequestError (or subclass) to reject the request: the
    caller gets that error and nothing is queued. Not called at all (no per-request cost)
    when no plugin implements it.
    """


@hookspec
def minisgl_request_finished(req: "Req") -> None:
    """Called by the scheduler once a sequence finishes (stop, length or abort), after its pages are released.

    req.finish_reason, req.prompt_len, req.prefix_hit_len (cached tokens), req.num_output and the
    timings req.arrival / req.first_token_time / req.finish_time (time.perf_counter) are set.
    """


@hookspec
def minisgl_batch_step(batch: "Batch") -> None:
    """Called after each forward pass with the batch just run (off the hot path unless implemented)."""


@hookspec
def minisgl_step_scheduled(batch: "Batch", schedule_s: float) -> None:
    """Called by the scheduler once it has chosen a step's batch, right before it queues the batch's forward.

    batch is the batch about to run (batch.is_prefill, batch.reqs, batch.extend_lens: the tokens each request
    computes); schedule_s is the host's seconds spent choosing it (prefill admission, else decode with any
    retraction). Device work queued here runs before the forward (e.g. a profiler's CUDA start event). The return
    value is ignored; an exception is logged and the step runs. Neither this nor minisgl_step_launched is called
    (no per-step cost) when no plugin implements one of them.
    """


@hookspec
def minisgl_step_launched(batch: "Batch", launch_s: float) -> None:
    """Called by the scheduler right after the batch's forward and sampling were queued, before its tokens are read.

    launch_s is the host's seconds spent queuing them (attention plan and kernel launches; on a CPU, the forward
    itself). On CUDA the device may still be running the step: a CUDA event recorded here completes with it.
    minisgl_batch_step follows once the step's tokens are on the host. Not called for a launch that raised. The
    return value is ignored; an exception is logged and the step goes on.
    """
