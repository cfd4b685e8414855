"""transformers' `generate` semantics on the minisgl scheduler.

prepare() resolves a call exactly as transformers does, with transformers' own helpers
(call kwargs > generation_config argument > model.generation_config > defaults; special
tokens, the inferred attention mask, num_return_sequences, max_length vs max_new_tokens,
the logits processors and stopping criteria). The processors it built are then read back
into SamplingParams; anything that has no exact minisgl equivalent raises
UnsupportedGenerationError, and the caller falls back to transformers.

run() feeds each prompt's real tokens (left padding stripped) to the scheduler and rebuilds
HF's [batch * num_return_sequences, prompt_len + new] matrix one column at a time: a column
is complete when every live row has its token. Each column goes through transformers' own
StoppingCriteriaList, exactly as in HF's decoding loop, so eos (int or list), max_length,
stop_strings, max_time and custom criteria stop rows at the same step; finished rows get
pad_token_id; the streamer gets the prompt, then one column per step, then end().
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from minisgl import InvalidRequestError, MiniSGLError, SamplingParams


class UnsupportedGenerationError(InvalidRequestError):
    """A generate() option minisgl cannot run exactly like transformers (raised when fallback=False)."""


# Model inputs that change how transformers computes, never what it returns.
_HARMLESS_MODEL_KWARGS = ("attention_mask", "use_cache")
# Per-step tensors only transformers' own forward produces.
_OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")

_call_ids = itertools.count()


@dataclass
class GenerateRequest:
    """One generate() call, resolved: what the scheduler runs and how to rebuild HF's output."""

    input_ids: torch.Tensor  # [batch * n, prompt_len] on the CPU: HF's expanded input, left padding kept
    prompts: list[list[int]]  # each prompt's real tokens (padding stripped), one per input row
    n: int  # num_return_sequences
    params: SamplingParams
    criteria: Any  # transformers StoppingCriteriaList
    pad_token_id: int | None
    pads_finished_rows: bool  # HF writes pad after a row finished only when a criterion knows eos
    return_dict: bool
    device: torch.device


def prepare(
    model: Any,
    inputs: torch.Tensor | None,
    generation_config: Any,
    logits_processor: Any,
    stopping_criteria: Any,
    kwargs: dict[str, Any],
    max_seq_len: int,
    model_eos: frozenset[int],
) -> GenerateRequest:
    """Resolve a generate() call like transformers; raise UnsupportedGenerationError for what minisgl cannot run."""
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import EosTokenCriteria, StoppingCriteriaList

    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    kwargs = dict(kwargs)
    tokenizer = _pop_call_only_kwargs(kwargs)
    config, model_kwargs, has_default_max_length, has_default_min_length = _resolve_config(
        model, generation_config, kwargs
    )
    inputs_tensor, input_name, model_kwargs = _model_input_ids(model, inputs, config, model_kwargs)

    device = inputs_tensor.device
    mask = model_kwargs.get("attention_mask")
    model._prepare_special_tokens(config, mask is not None, device=device, batch_size=inputs_tensor.shape[0])
    if mask is None:
        mask = model._prepare_attention_mask_for_generation(inputs_tensor, config, model_kwargs)
    prompts = strip_left_padding(inputs_tensor, mask)

    n = config.num_return_sequences or 1
    input_ids = inputs_tensor.repeat_interleave(n, dim=0).cpu()
    mask = (mask != 0).repeat_interleave(n, dim=0).cpu()
    prompt_len = input_ids.shape[1]
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name=input_name,
        input_ids_length=prompt_len,
        inputs_tensor=inputs_tensor,
    )
    model._validate_generated_length(config, prompt_len, has_default_max_length)
    # As transformers does, an all-ones mask is dropped before the processors see it.
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_len,
        encoder_input_ids=inputs_tensor,
        logits_processor=logits_processor,
        device=device,
        model_kwargs={"attention_mask": None if bool(mask.all()) else mask.long()},
    )
    criteria = model._get_stopping_criteria(
        generation_config=config, stopping_criteria=stopping_criteria, tokenizer=tokenizer
    )

    max_new = _max_new_tokens(criteria, config, prompt_len, prompts, max_seq_len)
    pad_lengths = prompt_len - mask.sum(dim=1)
    # The tokens transformers stops a row on: a custom EosTokenCriteria replaces the one built from eos_token_id.
    eos = set().union(*(_token_set(c.eos_token_id) for c in criteria if isinstance(c, EosTokenCriteria)))
    params = sampling_params(processors, config, prompt_len, max_new, pad_lengths, model_eos, eos, n)
    pads_finished_rows = any(hasattr(c, "eos_token_id") for c in criteria)
    pad = config._pad_token_tensor
    if pads_finished_rows and pad is None:
        raise UnsupportedGenerationError("a stopping criterion with eos_token_id but no pad_token_id or eos_token_id")
    return GenerateRequest(
        input_ids=input_ids,
        prompts=prompts,
        n=n,
        params=params,
        criteria=criteria,
        pad_token_id=None if pad is None else int(pad),
        pads_finished_rows=pads_finished_rows,
        return_dict=bool(config.return_dict_in_generate),
        device=device,
    )


def _pop_call_only_kwargs(kwargs: dict[str, Any]) -> Any:
    """Take the generate() kwargs that are no generation option out of kwargs; return the tokenizer."""
    kwargs.pop("trust_remote_code", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if kwargs.pop("assistant_tokenizer", None) is not None:
        raise UnsupportedGenerationError("assistant_tokenizer (assisted decoding)")
    if kwargs.get("cache_implementation") == "paged":
        raise UnsupportedGenerationError("cache_implementation='paged' (transformers' own continuous batching)")
    return tokenizer


def _resolve_config(
    model: Any, generation_config: Any, kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any], bool, bool]:
    """transformers' generation config for the call, its model kwargs, and whether max/min length were defaulted."""
    # Read before the config is resolved, as transformers does (# 6 of its generate).
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _check_generation_mode(config)
    model._validate_model_kwargs(model_kwargs.copy())
    return config, model_kwargs, has_default_max_length, has_default_min_length


def _check_generation_mode(config: Any) -> None:
    """Refuse the decoding modes and outputs only transformers' own loop produces."""
    from transformers.generation.configuration_utils import GenerationMode

    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise UnsupportedGenerationError(f"generation mode {mode.value!r} (minisgl runs greedy search and sampling)")
    if config.return_dict_in_generate:
        for flag in _OUTPUT_FLAGS:
            if getattr(config, flag, False):
                raise UnsupportedGenerationError(f"{flag} (per-step tensors of transformers' own forward)")
    if getattr(config, "token_healing", False):
        raise UnsupportedGenerationError("token_healing")


def _model_input_ids(
    model: Any, inputs: torch.Tensor | None, config: Any, model_kwargs: dict[str, Any]
) -> tuple[torch.Tensor, str, dict[str, Any]]:
    """transformers' model inputs for the call; only a 2-D input_ids with an attention mask is accepted."""
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(inputs, config.bos_token_id, model_kwargs)
    if input_name != "input_ids":
        raise UnsupportedGenerationError(f"{input_name} as the input (give input_ids)")
    if inputs_tensor.dim() != 2:
        raise UnsupportedGenerationError(f"{inputs_tensor.dim()}-D input_ids (give a [batch, tokens] tensor)")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _HARMLESS_MODEL_KWARGS)
    if extra:
        raise UnsupportedGenerationError(f"model inputs {extra}")
    return inputs_tensor, input_name, model_kwargs


def _max_new_tokens(criteria: Any, config: Any, prompt_len: int, prompts: list[list[int]], max_seq_len: int) -> int:
    """The new tokens transformers' criteria allow; raise when the longest prompt plus them passes the context."""
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    # transformers' loop ends by its criteria alone: a custom MaxLengthCriteria replaces the one built from max_length.
    max_length = min((c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)), default=config.max_length)
    max_new = max(1, max_length - prompt_len)
    longest = max(len(p) for p in prompts)
    if longest + max_new > max_seq_len:
        raise UnsupportedGenerationError(
            f"{longest} prompt tokens + {max_new} new tokens (more than the engine's context of {max_seq_len})"
        )
    return max_new


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens; only left padding (0...0 1...1) keeps HF's positions and attention."""
    mask = (attention_mask != 0).cpu()
    if mask.shape != input_ids.shape:
        raise UnsupportedGenerationError(f"an attention_mask shaped {tuple(mask.shape)}, not like input_ids")
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()) or bool((mask[:, 1:].int() < mask[:, :-1].int()).any()):
        raise UnsupportedGenerationError("an attention_mask that is not left padding (right pads, holes, empty rows)")
    ids = input_ids.cpu()
    return [row[row.shape[0] - length :].tolist() for row, length in zip(ids, lengths.tolist())]


def _token_set(ids: Any) -> set[int]:
    if ids is None:
        return set()
    if isinstance(ids, torch.Tensor):
        return set(ids.flatten().tolist())
    return {int(ids)} if isinstance(ids, int) else {int(i) for i in ids}


def sampling_params(
    processors: Any,
    config: Any,
    prompt_len: int,
    max_new: int,
    pad_lengths: torch.Tensor,
    model_eos: frozenset[int],
    eos: set[int],
    n: int = 1,
) -> SamplingParams:
    """Read transformers' logits processors back into SamplingParams; raise for those with no exact equivalent.

    transformers applies the list in order, custom processors (logits_processor=...) before the warpers it builds
    from the config; minisgl's sampler has one fixed order: penalties and min-length masks, temperature, then
    min-p and top-k, then top-p over what those kept. A list is read only when applying it in that order picks from
    the same distribution: temperatures multiply, top-k takes the smallest k, min-p the largest p; a penalty after a
    filter, a temperature or min-p after top-p or min-p, or top-k or a second top-p after top-p are refused. With
    do_sample=False every warper leaves the argmax where it was: the call stays greedy. eos: the tokens
    transformers' stopping criteria end a row on.
    """
    reading = _read_processors(processors, prompt_len, pad_lengths, eos)
    temperature, top_k, top_p, min_p, repetition, min_tokens = reading
    fields: dict[str, Any] = dict(temperature=0.0, repetition_penalty=repetition)
    if config.do_sample:
        fields.update(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    # The engine stops on (and masks before min_tokens) its own eos unless ignore_eos; it may
    # only do so when the model's eos ids are among this call's.
    use_model_eos = bool(model_eos) and model_eos <= eos
    if min_tokens > 0 and not use_model_eos and eos & model_eos:
        raise UnsupportedGenerationError(
            "min_new_tokens/min_length with an eos_token_id list that holds only some of the model's eos ids"
        )
    try:
        return SamplingParams(
            **fields,
            n=n,
            max_tokens=max_new,
            min_tokens=min(max(min_tokens, 0), max_new),
            stop_token_ids=sorted(eos),
            ignore_eos=not use_model_eos,
        )
    except InvalidRequestError as e:
        raise UnsupportedGenerationError(str(e)) from None


def _read_processors(
    processors: Any, prompt_len: int, pad_lengths: torch.Tensor, eos: set[int]
) -> tuple[float, int, float, float, float, int]:
    """(temperature, top_k, top_p, min_p, repetition_penalty, min_tokens) of transformers' processors, in the order
    rules of sampling_params; raise for a processor or an order minisgl's sampler cannot reproduce."""
    from transformers.generation import logits_process as lp

    temperature, top_k, top_p, min_p, repetition = 1.0, -1, 1.0, 0.0, 1.0
    min_tokens = 0
    filters: list[str] = []  # the filters (top-k, top-p, min-p) applied so far, in order
    for proc in processors:
        kind = type(proc)
        name = kind.__name__
        if getattr(proc, "filter_value", -float("inf")) != -float("inf"):
            raise UnsupportedGenerationError(f"{name} with filter_value={proc.filter_value}")
        if getattr(proc, "min_tokens_to_keep", 1) > 1:
            raise UnsupportedGenerationError(f"{name} with min_tokens_to_keep={proc.min_tokens_to_keep}")
        if kind is lp.TemperatureLogitsWarper:
            if "top-p" in filters or "min-p" in filters:  # those filters read the probabilities it changes
                raise UnsupportedGenerationError(f"{name} after a top-p or min-p filter")
            temperature *= float(proc.temperature)
        elif kind is lp.TopKLogitsWarper:
            if "top-p" in filters:
                raise UnsupportedGenerationError(f"{name} after a top-p filter")
            top_k = int(proc.top_k) if top_k < 0 else min(top_k, int(proc.top_k))
            filters.append("top-k")
        elif kind is lp.TopPLogitsWarper:
            if "top-p" in filters:
                raise UnsupportedGenerationError(f"two {name}s")
            top_p = float(proc.top_p)
            filters.append("top-p")
        elif kind is lp.MinPLogitsWarper:
            if "top-p" in filters:  # minisgl applies top-p to what min-p kept, renormalised
                raise UnsupportedGenerationError(f"{name} after a top-p filter (min_p with top_p < 1)")
            min_p = max(min_p, float(proc.min_p))
            filters.append("min-p")
        elif kind is lp.RepetitionPenaltyLogitsProcessor:
            if filters:
                raise UnsupportedGenerationError(f"{name} after a {filters[-1]} filter")
            # transformers < 5 has no prompt_ignore_length and penalises the padding too.
            _check_penalty_window(getattr(proc, "prompt_ignore_length", None), pad_lengths)
            repetition *= float(proc.penalty)
        elif kind is lp.MinLengthLogitsProcessor or kind is lp.MinNewTokensLengthLogitsProcessor:
            if filters:
                raise UnsupportedGenerationError(f"{name} after a {filters[-1]} filter")
            if _token_set(proc.eos_token_id) != eos:
                raise UnsupportedGenerationError(f"{name} with tokens other than eos_token_id")
            if kind is lp.MinLengthLogitsProcessor:
                min_tokens = max(min_tokens, proc.min_length - prompt_len)
            else:
                min_tokens = max(min_tokens, proc.prompt_length_to_skip + proc.min_new_tokens - prompt_len)
        elif kind is lp.InfNanRemoveLogitsProcessor or kind is lp.LogitNormalization:
            pass  # neither changes which token is picked
        else:
            raise UnsupportedGenerationError(f"logits processor {name}")
    return temperature, top_k, top_p, min_p, repetition, min_tokens


def _check_penalty_window(ignore: Any, pad_lengths: torch.Tensor) -> None:
    """minisgl penalises each prompt's real tokens: transformers must skip exactly the padding."""
    if ignore is None or isinstance(ignore, int):
        skipped = torch.full_like(pad_lengths, ignore or 0)
    else:
        skipped = ignore.cpu()
    if not torch.equal(skipped.to(pad_lengths.dtype), pad_lengths):
        raise UnsupportedGenerationError("repetition_penalty over a window other than each prompt's real tokens")


def run(llm: Any, request: GenerateRequest, streamer: Any = None) -> torch.Tensor:
    """Generate on the engine, step by step (minisgl.LLM's add_request/step/abort); returns HF's sequences [batch * n,
    prompt_len + new] on the CPU."""
    n, params = request.n, request.params
    rows, prompt_len = request.input_ids.shape
    max_new = params.max_tokens
    sequences = torch.empty(rows, prompt_len + max_new, dtype=torch.long)
    sequences[:, :prompt_len] = request.input_ids
    call = next(_call_ids)
    rids = [f"hf-generate-{call}-{i}" for i in range(len(request.prompts))]
    first_row = {rid: i * n for i, rid in enumerate(rids)}
    tokens: list[list[int]] = [[] for _ in range(rows)]
    engine_done = [False] * rows
    errors: list[str | None] = [None] * rows
    alive = [True] * rows
    unfinished = torch.ones(rows, dtype=torch.bool)
    in_engine = set(rids)
    pad, pads = request.pad_token_id, request.pads_finished_rows
    col = 0
    for prompt in request.prompts:  # nothing is queued unless everything can be
        llm.validate(prompt, params)
    seeds = _seeds(params, len(rids), n)
    try:
        for rid, prompt, seed in zip(rids, request.prompts, seeds):
            llm.add_request(rid, prompt, params if seed is None else replace(params, seed=seed))
        while col < max_new and _any_alive(alive):
            with torch.inference_mode():
                outputs = llm.step()
            for out in outputs:
                row = first_row[out.rid] + out.index
                tokens[row].extend(out.new_token_ids)
                if out.finished:
                    engine_done[row], errors[row] = True, out.error
            while col < max_new and _any_alive(alive) and _column_ready(col, tokens, engine_done, alive, pads, errors):
                column = torch.tensor(
                    [tokens[r][col] if alive[r] or not pads else pad for r in range(rows)], dtype=torch.long
                )
                sequences[:, prompt_len + col] = column
                col += 1
                unfinished &= ~request.criteria(sequences[:, : prompt_len + col], None).cpu()
                alive = unfinished.tolist()
                if streamer is not None:
                    streamer.put(column)
            # Requests whose every row is done (and padded from now on) stop running in the engine.
            for rid in [r for r in in_engine if pads and not any(alive[first_row[r] : first_row[r] + n])]:
                llm.abort(rid)
                in_engine.discard(rid)
            in_engine = {r for r in in_engine if not all(engine_done[first_row[r] : first_row[r] + n])}
            if _any_alive(alive) and col < max_new and not llm.has_work:
                raise MiniSGLError("the minisgl scheduler went idle before generate() finished; this is a bug")
    finally:
        for rid in in_engine:
            llm.abort(rid)
        with torch.inference_mode():
            llm.step()  # flush the aborts' outputs
    if streamer is not None:
        streamer.end()
    return sequences[:, : prompt_len + col]


def _seeds(params: SamplingParams, prompts: int, n: int) -> list[int | None]:
    """Each prompt's sampling seed, drawn from torch's global RNG as transformers' own sampling draws from it, so
    transformers.set_seed(s) before generate() reproduces the call (a prompt's n samples take seed, seed + 1, ...)."""
    if params.greedy or params.seed is not None:
        return [None] * prompts
    base = int(torch.randint(0, 2**62, ()).item())
    return [base + i * n for i in range(prompts)]


def _any_alive(alive: list[bool]) -> bool:
    return True in alive


def _column_ready(
    col: int, tokens: list[list[int]], engine_done: list[bool], alive: list[bool], pads: bool, errors: list[str | None]
) -> bool:
    for r, row_tokens in enumerate(tokens):
        if (alive[r] or not pads) and len(row_tokens) <= col:
            if engine_done[r]:
                raise MiniSGLError(
                    f"minisgl ended sequence {r} after {len(row_tokens)} tokens while transformers would go on"
                    + (f": {errors[r]}" if errors[r] else "")
                )
            return False
    return True
