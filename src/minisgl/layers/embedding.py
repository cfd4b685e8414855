"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.layers.linear import CpuGemm, copy_checked


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        # Pad so every rank holds the same number of rows; padded rows stay zero.
        self.num_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_partition
        self.vocab_end = min(self.vocab_start + self.num_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        rows = self.vocab_end - self.vocab_start
        if rows < param.shape[0]:
            param[rows:].zero_()
        copy_checked(param.narrow(0, 0, rows), loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        return all_reduce(local * mask.unsqueeze(-1).to(local.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> full-vocabulary logits (each rank computes its slice, then all-gather)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            raise ValueError("LM head bias is not supported")
        self.gemm = CpuGemm()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the input embedding's weight (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(self.gemm(hidden, self.weight))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from every rank's [..., num_per_partition] columns."""
        if self.tp_size == 1:
            return local
        return all_gather_last_dim(local)[..., : self.num_embeddings]
