"""Mixture-of-experts MLP: a softmax router picks top_k of num_experts SiLU-gated MLPs per token.

The experts' weights are stacked at load time: gate_up_proj [E, 2 * I, H] (gate rows, then up rows) and
down_proj [E, H, I]. Under tensor parallelism over P ranks the experts are laid out one of two ways
(EngineConfig.moe_parallel): "ep" (expert parallelism) gives rank r the whole experts [r * E / P, (r + 1) * E / P),
[E / P, 2 * I, H]; "tp" splits each expert's intermediate dimension I across the ranks like the dense MLP's, so
every rank holds every expert, [E, 2 * I / P, H]; "auto" (the default) is "ep" where P divides E, else "tp" ("ep"
measured 1.06x "tp" end to end at TP=2 on Qwen3-30B-A3B's shape: whole experts make longer GEMMs). Either way the
router is replicated, every rank sees every token (the activations are replicated at the MoE input) and computes
its part of each token's sum (under "ep" the pairs routed to another rank's experts add nothing here), and one
all-reduce per layer sums the ranks.

On CUDA one fused path runs (layers/fused_moe.py: routing kernel, tokens grouped by expert on the GPU, two
grouped GEMMs); elsewhere a plain loop over the experts that received tokens, in expert order like HF's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info, partial_out
from minisgl.errors import ConfigError, WeightsError
from minisgl.layers.activation import SiluAndMul
from minisgl.layers.fused_moe import fused_moe
from minisgl.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
    divide,
)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]): the top_k of the softmax over the experts."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_loop(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), one matmul pair per expert that received tokens.

    gate_up and down hold the experts [expert_offset, expert_offset + len(gate_up)) of the global ids; the pairs
    routed to other experts add nothing (expert parallelism: another rank computes them)."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    local = gate_up.shape[0]
    counts = torch.bincount(ids.flatten(), minlength=expert_offset + local)[expert_offset : expert_offset + local]
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        token, slot = torch.where(ids == expert_offset + expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SiLU-gated MLP (split across ranks like the dense one) whose output a
    per-token sigmoid gate scales; forward returns this rank's partial sums."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)), reduce=False) * torch.sigmoid(gate)


class FusedMoE(nn.Module):
    """The routed experts of one layer (and Qwen2-MoE's shared expert where shared_intermediate_size > 0);
    forward(x [T, H]) -> [T, H] (this rank's partial sums if reduce=False). Under TP with expert parallelism
    (distributed.TPInfo.moe_parallel) this rank holds whole experts [expert_offset, expert_offset + E / P)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # "auto": whole experts wherever the ranks divide them (faster at TP=2 on Qwen3-30B-A3B, docs/benchmarks.md)
        divides = num_experts % tp.size == 0
        ep = tp.size > 1 and (tp.moe_parallel == "ep" or (tp.moe_parallel == "auto" and divides))
        if tp.moe_parallel == "ep" and not divides:
            raise ConfigError(
                f"moe_parallel='ep' gives each of the {tp.size} ranks the same number of whole experts, but the "
                f"model has {num_experts}: use a tp that divides {num_experts}, or moe_parallel='tp'"
            )
        # This rank's experts (all of them under "tp") and the slice of I it holds of each (all of it under "ep").
        self.num_local_experts = num_experts // tp.size if ep else num_experts
        self.expert_offset = tp.rank * self.num_local_experts if ep else 0
        self.inter = intermediate_size if ep else divide(intermediate_size, tp.size)
        self.inter_start = 0 if ep else tp.rank * self.inter
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)  # the router
        local = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * self.inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, self.inter), requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        # One checkpoint tensor per (expert, projection): gate (0) and up (1) into gate_up, down into down_proj. The
        # ids are global, so the load checks every expert of the checkpoint, this rank's or not.
        self.gate_up_proj.shard_ids = tuple((e, j) for e in range(num_experts) for j in (0, 1))
        self.down_proj.shard_ids = tuple((e, 2) for e in range(num_experts))
        self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        # FP8 experts on a GPU (layers/quantize.py: to_fp8_gemms): per-channel scales of gate_up and down.
        self.fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if not (isinstance(shard_id, tuple) and 0 <= shard_id[0] < self.num_experts):
            raise WeightsError(f"expert weights load one (expert, projection) at a time, got shard {shard_id!r}")
        expert, proj = shard_id
        expert -= self.expert_offset
        if not 0 <= expert < self.num_local_experts:
            return  # another rank's expert (expert parallelism)
        start, size = self.inter_start, self.inter
        if proj == 2:  # down [H, I]: this rank's columns
            copy_checked(param[expert], loaded.narrow(1, start, size))
        else:  # gate or up [I, H]: this rank's rows, into its half of gate_up
            copy_checked(param[expert].narrow(0, proj * size, size), loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        router_logits = self.gate(x)
        if x.is_cuda:
            # Partial sums the next norm reduces go straight into its buffer (tp_allreduce="fused" / "fused_ll").
            into = None if reduce or self.shared_expert is not None else partial_out(x.shape[0], x.shape[1], x.dtype)
            out = fused_moe(
                x,
                router_logits,
                self.gate_up_proj,
                self.down_proj,
                self.top_k,
                self.renormalize,
                self.fp8_scales,
                into,
                self.expert_offset,
            )
        else:
            weights, ids = route(router_logits, self.top_k, self.renormalize)
            out = experts_loop(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + self.shared_expert(x, self.shared_expert_gate(x))
        return all_reduce(out) if reduce else out
