"""What a forward hands the scheduler (ForwardOutput), and the per-row results read from a prefill's hidden states:
the prompt logprobs a request asked for, and the embeddings of embedding requests."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from minisgl.core import Batch
from minisgl.engine.sampler import token_logprobs


class ForwardOutput(NamedTuple):
    """Engine.forward_and_sample's result. next_ids: the sampled ids on the device (None when nothing is sampled:
    a middle chunk of a prompt, its KV only); logprobs: theirs, or None; prompt_logprobs: {batch row: entries}
    for the rows that asked (SamplingParams.prompt_logprobs), or None; embeddings: {batch row: vector} for the
    embedding requests whose prompt ends in this chunk, or None. The last two wait for the device."""

    next_ids: torch.Tensor | None = None
    logprobs: list[Any] | None = None
    prompt_logprobs: dict[int, list[Any]] | None = None
    embeddings: dict[int, list[float]] | None = None


def prompt_logprobs(
    batch: Batch, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> dict[int, list[Any]]:
    """{batch row: logprob entries of the prompt tokens this chunk predicts} for the requests that want them.

    A request's rows cover positions cached_len .. cached_len + extend - 1; row p predicts token p + 1,
    a prompt token while p + 1 < prompt_len (the last prompt position predicts the first output token).
    """
    out: dict[int, list[Any]] = {}
    offset = 0
    for i, (req, extend) in enumerate(zip(batch.reqs, batch.extend_lens)):
        if req.wants_prompt_logprobs:
            start, stop = req.cached_len, min(req.cached_len + extend, req.prompt_len - 1)
            targets = torch.tensor(req.input_ids[start + 1 : stop + 1], dtype=torch.int64).to(device)
            out[i] = token_logprobs(
                compute_logits,
                hidden[offset : offset + max(0, stop - start)],
                targets,
                req.sampling_params.prompt_logprobs,
            )
        offset += extend
    return out


def embeddings(batch: Batch, hidden: torch.Tensor) -> dict[int, list[float]] | None:
    """{batch row: L2-normalised float32 hidden state of the last prompt token} for the embedding requests
    whose prompt this chunk finishes (last-token pooling, as vLLM pools decoder models)."""
    rows, ends, end = [], [], 0
    for i, (req, extend) in enumerate(zip(batch.reqs, batch.extend_lens)):
        end += extend
        if req.embed and req.cached_len + extend == req.prompt_len:
            rows.append(i)
            ends.append(end - 1)
    if not rows:
        return None
    last = hidden[torch.tensor(ends, device=hidden.device)].float()
    vectors = torch.nn.functional.normalize(last, dim=-1).tolist()
    return dict(zip(rows, vectors))
