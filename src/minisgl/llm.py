"""The offline API: LLM(...).generate / .chat run the scheduler in-process, without sockets."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from minisgl.config import EngineConfig
from minisgl.core import CompletionOutput, FirstOutputShortcuts, SamplingParams, TokenOutput
from minisgl.errors import EngineError, InvalidRequestError
from minisgl.tokenizer import IncrementalDetokenizer, apply_chat_template, encode_prompt, shown_ids


@dataclass
class RequestOutput(FirstOutputShortcuts):
    """Everything generated for one prompt; .text/.token_ids/.finish_reason are the first sample's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    error: str | None = None
    # With SamplingParams.prompt_logprobs: per prompt token (logprob, [(token_id, logprob), ...top-k]), None first.
    prompt_logprobs: list[Any] | None = None
    spec_accepted_tokens: int = 0  # of completion_tokens, draft tokens accepted (speculative="ngram")

    @property
    def logprobs(self) -> list[Any] | None:
        return self.outputs[0].logprobs


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text, token ids, a prompt dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            f"prompts must be text, a list of token ids, a prompt dict or a list of those, got {type(prompts).__name__}"
        )
    return list(prompts)


class _Sequence:
    """One sequence's outputs as generate() gathers them: token ids and logprobs in flat lists, the latest
    TokenOutput (finish reason, counts) and the first prompt logprobs seen.

    Keeping every step's TokenOutput instead kept ~2 objects per generated token alive until the end, and
    Python's full garbage collections over that growing heap stopped the loop for ~0.3 s at a time: 0.64 s
    of an 8.0 s, 134k-token batch on one H100.
    """

    __slots__ = ("token_ids", "logprobs", "last", "prompt_logprobs")

    def __init__(self, first: TokenOutput) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.last = first
        self.prompt_logprobs: list[Any] | None = None
        self.add(first)

    def add(self, out: TokenOutput) -> None:
        self.token_ids += out.new_token_ids
        if out.new_logprobs:
            self.logprobs += out.new_logprobs
        if self.prompt_logprobs is None and out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


class LLM:
    """An engine in this process.

    >>> llm = LLM("smollm2")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].text
    """

    def __init__(
        self,
        model: Any = "smollm2",
        dtype: str | None = None,
        cache: str = "radix",
        page_size: int | None = None,
        max_prefill_tokens: int = 4096,
        max_running_requests: int = 256,
        tp: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        model_source = None if isinstance(model, str) else model
        # Offline, whole batches matter, not one stream's gap: prefill first (and the chunks, so the results, do not
        # depend on measured step times). A daemon bounds the gap (max_decode_gap's device default).
        engine_kwargs.setdefault("max_decode_gap", 0.0)
        name = (
            model if isinstance(model, str) else getattr(getattr(model, "config", None), "name_or_path", "") or "model"
        )
        self.config = EngineConfig.from_kwargs(
            str(name),
            dtype=dtype,
            cache=cache,
            page_size=page_size,
            max_prefill_tokens=max_prefill_tokens,
            max_running_requests=max_running_requests,
            tp=tp,
            **engine_kwargs,
        )
        if tp > 1:
            from minisgl.runtime.tp import TPScheduler  # lazy: torch, when an LLM is built

            self.scheduler: Any = TPScheduler(self.config)
        else:
            from minisgl.scheduler.scheduler import Scheduler  # lazy: torch, when an LLM is built

            self.scheduler = Scheduler(self.config, model_source)
        self.tokenizer = self.scheduler.tokenizer
        self._ids = itertools.count()

    @property
    def model_config(self) -> Any:
        return self.scheduler.model_config

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (str or token ids), batched by the scheduler; outputs keep prompt order.

        Raises EngineError when a forward pass fails (the engine stays usable; nothing is left in flight).
        """
        prompts = _prompt_list(prompts)
        if not prompts:
            return []
        token_lists = [self._prompt_ids(p) for p in prompts]
        return self._generate_ids(token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """One conversation -> one output; a list of conversations -> a list of outputs.

        chat_template_kwargs: extra chat-template variables, e.g. {"enable_thinking": False} for Qwen3.
        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of message dicts (or of conversations)")
        single = isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        token_lists = [
            apply_chat_template(self.tokenizer, conv, tools=tools, chat_template_kwargs=chat_template_kwargs)  # type: ignore[arg-type]
            for conv in conversations
        ]
        outs = self._generate_ids(token_lists, sampling_params, use_tqdm)
        return outs[0] if single else outs

    def embed(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]]) -> list[list[float]]:
        """Embeddings of the prompts (texts or token ids), in order: each prompt's last hidden state after the
        final norm, L2-normalised (last-token pooling, as vLLM's LLM.embed pools decoder models). Batched and
        prefix-cached like generate; raises EngineError when a forward pass fails."""
        prompts = _prompt_list(prompts)
        if not prompts:
            raise InvalidRequestError("embed takes a prompt (text or token ids) or a non-empty list of prompts")
        token_lists = [self._prompt_ids(p) for p in prompts]
        params = SamplingParams.for_embedding()
        for ids in token_lists:
            self.scheduler.validate(ids, params.for_prompt(len(ids), self.max_seq_len))
        rids = [f"embed-{next(self._ids)}" for _ in token_lists]
        vectors: dict[str, list[float]] = {}
        try:
            for rid, ids in zip(rids, token_lists):
                self.scheduler.add_request(rid, ids, params, embed=True)
            while len(vectors) < len(rids):
                for out in self.scheduler.step():
                    if out.error_type == EngineError.__name__:
                        raise EngineError(out.error)
                    if out.embedding is not None:
                        vectors[out.rid] = out.embedding
                    elif out.finished:
                        raise EngineError(out.error or f"embedding request {out.rid} ended without a vector")
        except BaseException:
            for rid in rids:
                self.scheduler.abort(rid)
            self.scheduler.step()  # flush the aborts' outputs
            raise
        return [vectors[rid] for rid in rids]

    def _prompt_ids(self, prompt: Any) -> list[int]:
        """One prompt's token ids: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys == {"prompt"}:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise InvalidRequestError(f'a {{"prompt": ...}} prompt must hold text, got {type(prompt).__name__}')
            elif keys == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise InvalidRequestError('a {"prompt_token_ids": ...} prompt must hold a list of token ids')
            else:
                raise InvalidRequestError(
                    f"a prompt dict takes exactly one of the keys 'prompt' (text) or 'prompt_token_ids', got "
                    f"{sorted(keys)}"
                )
        if not isinstance(prompt, (str, list, tuple)):
            raise InvalidRequestError(
                f"a prompt is text, a list of token ids or a prompt dict, got {type(prompt).__name__}"
            )
        return encode_prompt(self.tokenizer, prompt)

    def _generate_ids(self, token_lists: list[list[int]], sampling_params: Any, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            params_list = [SamplingParams()] * len(token_lists)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            wrong = (
                [sampling_params]
                if isinstance(sampling_params, (str, dict)) or not isinstance(sampling_params, Sequence)
                else [p for p in sampling_params if not isinstance(p, SamplingParams)]
            )
            if wrong:
                raise InvalidRequestError(
                    "sampling_params must be a SamplingParams or a list of them (one per prompt), got a "
                    f"{type(wrong[0]).__name__}; build one with SamplingParams(**kwargs)"
                )
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(token_lists)} prompts: give one, or one per prompt"
                )
        # Validate everything before queueing anything: nothing fails half-way.
        for ids, params in zip(token_lists, params_list):
            self.scheduler.validate(ids, params)
        rids = [f"offline-{next(self._ids)}" for _ in token_lists]
        collected: dict[str, dict[int, _Sequence]] = {rid: {} for rid in rids}
        remaining = {rid: p.n for rid, p in zip(rids, params_list)}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm  # lazy: 0.3 s to import, for the progress bar only

            bar = tqdm(total=len(rids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            for rid, ids, params in zip(rids, token_lists, params_list):
                self.scheduler.add_request(rid, ids, params)
            while any(remaining.values()):
                for out in self.scheduler.step():
                    if out.error_type == EngineError.__name__:  # a failed forward: no output for this prompt
                        raise EngineError(out.error)
                    seqs = collected[out.rid]
                    if out.index in seqs:
                        seqs[out.index].add(out)
                    else:
                        seqs[out.index] = _Sequence(out)
                    if out.finished:
                        remaining[out.rid] -= 1
                        if remaining[out.rid] == 0 and bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in rids:
                self.scheduler.abort(rid)
            self.scheduler.step()  # flush the aborts' outputs
            raise
        finally:
            if bar is not None:
                bar.close()
        return [
            self._assemble(rid, ids, params, collected[rid]) for rid, ids, params in zip(rids, token_lists, params_list)
        ]

    def _assemble(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, per_index: dict[int, _Sequence]
    ) -> RequestOutput:
        outputs = []
        for index in range(params.n):
            seq = per_index[index]
            text = ""
            if self.tokenizer is not None:  # an engine built from a bare model has token ids only
                detok = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens
                )
                shown = shown_ids(seq.token_ids, seq.last.finish_reason, seq.last.matched_stop)
                text = detok.add(shown) + detok.finish()
            outputs.append(
                CompletionOutput(
                    index,
                    text,
                    seq.token_ids,
                    seq.last.finish_reason,
                    seq.last.matched_stop,
                    logprobs=seq.logprobs if params.logprobs is not None else None,
                )
            )
        last = per_index[params.n - 1].last
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            outputs=outputs,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=per_index[0].last.cached_tokens,
            completion_tokens=sum(per_index[i].last.completion_tokens for i in range(params.n)),
            error=last.error,
            prompt_logprobs=per_index[0].prompt_logprobs,
            spec_accepted_tokens=sum(per_index[i].last.spec_accepted_tokens for i in range(params.n)),
        )

    # ------------------------------------------------------------------ step by step (as vLLM's LLMEngine)

    @property
    def max_seq_len(self) -> int:
        """The context window: prompt + output tokens of one sequence."""
        return self.scheduler.max_seq_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.scheduler.eos_token_ids

    @property
    def has_work(self) -> bool:
        """Whether a request is waiting or running (step() has something to do)."""
        return self.scheduler.has_work

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise the typed error add_request would raise for this request; queues nothing."""
        self.scheduler.validate(prompt_ids, params.for_prompt(len(prompt_ids), self.max_seq_len))

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a tokenized request; its tokens come back from step() as TokenOutputs with this rid."""
        self.scheduler.add_request(rid, prompt_ids, params)

    def step(self) -> list[TokenOutput]:
        """Run one engine step; the new tokens (and finished sequences) of every request it advanced."""
        return self.scheduler.step()

    def abort(self, rid: str) -> None:
        """Stop a request; its pages are freed and its last output says "abort"."""
        self.scheduler.abort(rid)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy (HF-named) weights into the running model and forget every prefix cached with the old ones.

        For an engine in this process only (tp=1); requests in flight keep the KV they computed.
        """
        if self.config.tp > 1:
            raise InvalidRequestError("load_weights needs tp=1 (the ranks hold shards of the weights)")
        self.scheduler.engine.load_weights(weights)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no request holds (e.g. after the weights changed)."""
        self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Abort what is in flight and stop the engine (and its TP ranks)."""
        self.scheduler.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def check_integrity(self) -> None:
        """Assert that no KV page leaked: free + cached + owned by requests == total."""
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, int]:
        return self.scheduler.stats()
