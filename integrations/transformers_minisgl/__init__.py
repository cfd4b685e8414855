"""Drop-in `model.generate` for transformers models, run by minisgl.

>>> from transformers_minisgl import patch_generate, unpatch_generate, minisgl_generate
>>> patch_generate(model)            # model.generate now runs on minisgl
>>> out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)
>>> unpatch_generate(model)          # transformers' generate again
>>> with minisgl_generate(model):    # or scoped
...     out = model.generate(...)

The result is what transformers returns: a LongTensor [batch * num_return_sequences,
prompt_len + new] on the input's device (left padding kept, finished rows padded, stopped when
every row is done), or a GenerateDecoderOnlyOutput with return_dict_in_generate (its
past_key_values is None: the KV lives in minisgl's paged pool).

Weights: patch_generate builds an engine in this process from the model's config and current
state_dict. Every call first checks the model's parameters (identity, storage, version counter;
see weights.py) and, when they changed (an optimizer step, load_state_dict, an in-place edit),
copies them into the engine again and clears its prefix cache. After writes through
`param.data`, which PyTorch does not count, call sync_weights(model).

Falls back to transformers' own generate (warning once per reason), or raises
UnsupportedGenerationError with fallback=False, for what the engine cannot run exactly:
beam search and the other non-sampling modes, assistant_model, prefix_allowed_tokens_fn,
negative prompts, custom_generate, logits processors other than temperature / top-k / top-p /
min-p / repetition penalty / min length or in an order minisgl's sampler does not share (min_p with top_p < 1
in transformers' order: top-p first), output_scores / output_logits / attentions / hidden
states, inputs_embeds or extra model inputs, attention masks that are not left padding, and
prompts longer than the engine's context. Custom stopping_criteria are honoured (they run on
the rebuilt sequences, on the CPU, once per step, as in transformers).

Sampling (do_sample=True) uses minisgl's sampler: the same distribution, not the same draws; its seeds come
from torch's global RNG, so transformers.set_seed(s) before generate() reproduces a call, as in transformers.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from types import MethodType
from typing import Any, Iterator

import torch

from transformers_minisgl.generate import UnsupportedGenerationError, prepare, run
from transformers_minisgl.weights import WeightWatcher

__all__ = ["patch_generate", "unpatch_generate", "minisgl_generate", "sync_weights", "UnsupportedGenerationError"]

_STATE = "_minisgl_generate"
# minisgl's forward context (attention backend, KV pool) is process-wide: one engine runs at a time.
_ENGINE_LOCK = threading.RLock()
# On CUDA the patched engine's KV pool takes this fraction of the free memory (mem_fraction=... overrides).
PATCH_MEM_FRACTION = 0.5


class PatchedGenerate:
    """What patch_generate attaches to a model: its engine, the weight watcher, the original generate."""

    def __init__(self, model: Any, fallback: bool, engine_kwargs: dict[str, Any]) -> None:
        self.fallback = fallback
        self.had_own_generate = "generate" in vars(model)
        self.original = model.generate
        self.engine_kwargs = engine_kwargs
        self.placement = _placement(model, engine_kwargs)
        self.llm = _build_engine(model, engine_kwargs)
        self.weights = WeightWatcher(model, self.llm)
        self.warned: set[str] = set()

    def follow(self, model: Any) -> None:
        """Rebuild the engine where the model went since (model.to(...), .cuda(), .half()), as its generate would
        run."""
        placement = _placement(model, self.engine_kwargs)
        if placement == self.placement:
            return
        self.llm.shutdown()
        self.llm = _build_engine(model, self.engine_kwargs)
        self.weights = WeightWatcher(model, self.llm)
        self.placement = placement

    def fall_back(self, reason: str) -> None:
        """Warn once per reason, or raise when fallback is off."""
        if not self.fallback:
            raise UnsupportedGenerationError(
                f"minisgl cannot run generate() with {reason} exactly like transformers; drop that option, "
                "or patch with fallback=True to hand such calls to transformers"
            )
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(
                f"minisgl cannot run generate() with {reason}; using transformers' generate for such calls "
                "(this warning is shown once)",
                UserWarning,
                stacklevel=3,
            )

    def close(self) -> None:
        self.llm.shutdown()


def _placement(model: Any, engine_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The engine's device and dtype: those given to patch_generate, else the model's now."""
    param = next(model.parameters())
    return (
        engine_kwargs.get("device", str(param.device)),
        engine_kwargs.get("dtype", str(param.dtype).removeprefix("torch.")),
    )


def _build_engine(model: Any, engine_kwargs: dict[str, Any]) -> Any:
    from minisgl import LLM, ConfigError

    kwargs = dict(engine_kwargs)
    if kwargs.get("tp", 1) != 1:
        raise ConfigError("patch_generate runs the model's own weights in this process: tp must be 1")
    kwargs["device"], kwargs["dtype"] = _placement(model, engine_kwargs)
    param = next(model.parameters())
    if param.device.type == "cuda" and "num_pages" not in kwargs:
        # The model's process goes on using the GPU (training, transformers' own generate): the KV
        # pool takes half of the memory free now, not the serving default.
        kwargs.setdefault("mem_fraction", PATCH_MEM_FRACTION)
    devices = [param.device.index or 0] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the engine seeds torch: leave the user's RNG as it was
        return LLM(model, **kwargs)


def patch_generate(model: Any, fallback: bool = True, **engine_kwargs: Any) -> Any:
    """Make model.generate run on a minisgl engine built from the model's current weights; returns model.

    engine_kwargs go to minisgl.LLM (cache, page_size, max_running_requests, kv_cache_gb, mem_fraction, ...);
    device and dtype default to the model's, and follow it: a generate call after model.to(...) rebuilds the
    engine there. On CUDA the KV pool takes half of the free memory (PATCH_MEM_FRACTION) so the rest of the
    process keeps room. Patching a patched model rebuilds its engine.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"patch_generate needs a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model, _STATE, None) is not None:
        unpatch_generate(model)
    state = PatchedGenerate(model, fallback, engine_kwargs)
    setattr(model, _STATE, state)
    model.generate = MethodType(_generate, model)
    return model


def unpatch_generate(model: Any) -> Any:
    """Restore the generate model had before patch_generate and free the engine; returns model."""
    state: PatchedGenerate | None = getattr(model, _STATE, None)
    if state is None:
        return model
    if state.had_own_generate:
        model.generate = state.original
    else:
        del model.generate
    delattr(model, _STATE)
    state.close()
    return model


@contextmanager
def minisgl_generate(model: Any, fallback: bool = True, **engine_kwargs: Any) -> Iterator[Any]:
    """Scoped patch_generate; a model that was patched already stays patched (and keeps its engine)."""
    patched_here = getattr(model, _STATE, None) is None
    if patched_here:
        patch_generate(model, fallback=fallback, **engine_kwargs)
    try:
        yield model
    finally:
        if patched_here:
            unpatch_generate(model)


def sync_weights(model: Any) -> None:
    """Copy the model's weights into its engine now (needed only after writes through param.data)."""
    state: PatchedGenerate | None = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("sync_weights: the model is not patched; call patch_generate(model) first")
    with _ENGINE_LOCK:
        state.weights.sync()


def _generate(
    model: Any,
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    prefix_allowed_tokens_fn: Any = None,
    synced_gpus: bool | None = None,
    assistant_model: Any = None,
    streamer: Any = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    custom_generate: Any = None,
    **kwargs: Any,
) -> Any:
    """transformers' generate signature; runs on minisgl or hands the call to the original generate."""
    state: PatchedGenerate = getattr(model, _STATE)
    explicit = {
        name: value
        for name, value in dict(
            generation_config=generation_config,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            synced_gpus=synced_gpus,
            assistant_model=assistant_model,
            streamer=streamer,
            negative_prompt_ids=negative_prompt_ids,
            negative_prompt_attention_mask=negative_prompt_attention_mask,
            custom_generate=custom_generate,
        ).items()
        if value is not None
    }
    reason = _unsupported_argument(explicit)
    if reason is None:
        with _ENGINE_LOCK, torch.no_grad():
            state.follow(model)
            llm = state.llm
            try:
                request = prepare(
                    model,
                    inputs,
                    generation_config,
                    logits_processor,
                    stopping_criteria,
                    kwargs,
                    llm.max_seq_len,
                    llm.eos_token_ids,
                )
            except UnsupportedGenerationError as e:
                reason = str(e)
            else:
                state.weights.sync_if_changed()
                if streamer is not None:
                    streamer.put(request.input_ids)
                sequences = run(llm, request, streamer).to(request.device)
                if not request.return_dict:
                    return sequences
                from transformers.generation.utils import GenerateDecoderOnlyOutput

                return GenerateDecoderOnlyOutput(sequences=sequences)
    state.fall_back(reason)
    return state.original(inputs, **explicit, **kwargs)


def _unsupported_argument(explicit: dict[str, Any]) -> str | None:
    if "custom_generate" in explicit:
        return "custom_generate"
    if "assistant_model" in explicit:
        return "assistant_model (assisted decoding)"
    if "prefix_allowed_tokens_fn" in explicit:
        return "prefix_allowed_tokens_fn"
    if "negative_prompt_ids" in explicit or "negative_prompt_attention_mask" in explicit:
        return "negative_prompt_ids (classifier-free guidance)"
    if explicit.get("synced_gpus"):
        return "synced_gpus"
    return None
