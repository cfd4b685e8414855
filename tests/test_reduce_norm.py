"""The fused all-reduce + residual add + RMSNorm kernel (distributed/reduce_norm.py) against float32 PyTorch math.

Its ranks are simulated in one process: each "rank" is a launch with its own partial sums, residual and barrier
flags, the addresses of all ranks' partial sums and flags passed as they are on a real tensor-parallel host
(where they are symmetric-memory mappings of the peers' buffers). On the CPU (Triton's interpreter, fresh
process) and on a GPU the ranks run one after the other, the first one's flags set as if its peer had arrived;
on a GPU they also run at the same time on two streams, through the real barrier, many calls in a row.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import interpreter_or_cuda, run_interpreter_cases


def test_the_kernel_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=5, timeout=600)


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-interpreter", "cuda"])
def device(request: pytest.FixtureRequest):
    interpreter_or_cuda(request.param)
    return request.param


def reference(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm, new residual): the ranks' sum in float32 rounded to the dtype (a two-rank all-reduce), plus the
    residual in float32, normalized in float32 (flashinfer's fused_add_rmsnorm)."""
    dtype = residual.dtype
    x = torch.stack([p.float() for p in partials]).sum(0).to(dtype).float() + residual.float()
    norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return norm.to(dtype), x.to(dtype)


class Ranks:
    """world simulated ranks' partial sums, residuals (the same on every rank, as in a decoder) and flags."""

    def __init__(self, world: int, rows: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0) -> None:
        from minisgl.distributed.reduce_norm import MAX_PROGRAMS

        g = torch.Generator().manual_seed(seed)
        self.partials = [torch.randn(rows, hidden, generator=g).to(device, dtype) for _ in range(world)]
        residual = torch.randn(rows, hidden, generator=g).to(device, dtype)
        self.residuals = [residual.clone() for _ in range(world)]
        self.weight = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
        self.flags = [torch.zeros(MAX_PROGRAMS, world, dtype=torch.int32, device=device) for _ in range(world)]
        self.bufs = torch.tensor([p.data_ptr() for p in self.partials], dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=device)
        self.expected = reference(self.partials, residual, self.weight, 1e-6)

    def run(self, rank: int, programs: int) -> torch.Tensor:
        from minisgl.distributed.reduce_norm import reduce_add_rmsnorm

        rows = self.partials[rank].shape[0]
        return reduce_add_rmsnorm(
            self.bufs, self.flag_ptrs, rank, rows, self.residuals[rank], self.weight, 1e-6, programs=programs
        )

    def check(self, rank: int, out: torch.Tensor) -> None:
        norm, summed = self.expected
        if self.residuals[rank].is_cuda or summed.dtype != torch.bfloat16:
            torch.testing.assert_close(self.residuals[rank], summed, atol=0, rtol=0)
            torch.testing.assert_close(out.float(), norm.float(), atol=2e-2, rtol=2e-2)
        else:  # Triton's interpreter rounds to bf16 its own way (fp16 cases are exact there)
            torch.testing.assert_close(self.residuals[rank].float(), summed.float(), atol=6e-2, rtol=2e-2)
            torch.testing.assert_close(out.float(), norm.float(), atol=6e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("world", "rows", "hidden", "dtype", "programs"),
    [
        (1, 5, 64, torch.float16, 4),
        (2, 37, 96, torch.float16, 8),
        (2, 3, 128, torch.bfloat16, 8),
    ],
    ids=["world1", "world2-fp16-37rows", "world2-bf16-3rows"],
)
def test_ranks_one_after_the_other_match_float32_math(device, world, rows, hidden, dtype, programs):
    """37 rows over 8 programs: each program takes several rows; a hidden size of 96 masks its last columns."""
    ranks = Ranks(world, rows, hidden, dtype, device)
    grid = min(rows, programs)
    if world == 2:
        ranks.flags[0][:grid, 1] = 1  # rank 0 finds rank 1 arrived, so it finishes before rank 1 starts
    outs = [ranks.run(r, programs) for r in range(world)]
    for r in range(world):
        ranks.check(r, outs[r])
    if world == 2:
        assert not ranks.flags[1].any()  # rank 1 saw rank 0's arrival and cleared it
        assert (
            ranks.flags[0][:grid, 1].eq(1).all() and not ranks.flags[0][:, 0].any() and not ranks.flags[0][grid:].any()
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_ranks_at_the_same_time_through_the_barrier_many_calls():
    """Two ranks on two streams, meeting at the kernel's barrier: every call's result right, flags back to zero.
    Each call gets fresh inputs but the same flags, so a flag left set or cleared twice shows up as a hang or a
    wrong sum in a later call (rows 1 to 300: one program to several rows a program)."""
    pytest.importorskip("triton")
    streams = [torch.cuda.Stream() for _ in range(2)]
    flags = None
    for call, rows in enumerate([1, 5, 64, 37, 300, 2, 128, 300, 1, 77] * 3):
        ranks = Ranks(2, rows, 1024, torch.bfloat16, "cuda", seed=call)
        if flags is not None:  # the flags of the previous calls
            ranks.flags, ranks.flag_ptrs = flags
        torch.cuda.synchronize()
        outs = [None, None]
        for r in (1, 0):  # rank 1 first: it waits for rank 0 at the barrier
            with torch.cuda.stream(streams[r]):
                outs[r] = ranks.run(r, programs=64)
        torch.cuda.synchronize()
        for r in range(2):
            ranks.check(r, outs[r])
        flags = ranks.flags, ranks.flag_ptrs
    assert not flags[0][0].any() and not flags[0][1].any()


class LowLatencyRanks(Ranks):
    """Ranks for reduce_add_rmsnorm_ll: each rank's inbox (a segment per rank) starts with every cell -0.0 (empty)."""

    def __init__(
        self, world: int, rows: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0, inboxes=None
    ) -> None:
        super().__init__(world, rows, hidden, dtype, device, seed)
        self.seg = rows * hidden
        self.inboxes = inboxes or [
            torch.full((world * self.seg,), -0.0, dtype=dtype, device=device) for _ in range(world)
        ]
        self.inbox_ptrs = torch.tensor([b.data_ptr() for b in self.inboxes], dtype=torch.int64, device=device)

    def inbox(self, rank: int, sender: int) -> torch.Tensor:
        return self.inboxes[rank][sender * self.seg : (sender + 1) * self.seg].view_as(self.partials[rank])

    def empty(self, rank: int, sender: int) -> bool:
        return bool(self.inbox(rank, sender).view(torch.int16).eq(-32768).all())

    def run(self, rank: int, programs: int) -> torch.Tensor:
        from minisgl.distributed.reduce_norm import reduce_add_rmsnorm_ll

        return reduce_add_rmsnorm_ll(
            self.partials[rank], self.inbox_ptrs, self.seg, rank, self.residuals[rank], self.weight, 1e-6, programs
        )


@pytest.mark.parametrize(
    ("rows", "hidden", "dtype", "programs"),
    [(37, 96, torch.float16, 8), (3, 128, torch.bfloat16, 8)],
    ids=["fp16-37rows", "bf16-3rows"],
)
def test_low_latency_ranks_one_after_the_other_match_float32_math(device, rows, hidden, dtype, programs):
    """Rank 0 finds rank 1's rows already in its inbox (as if rank 1 had run first), stores its own into rank 1's
    and empties what it read; then rank 1 runs. A -0.0 in the partial sums (the empty mark) arrives as +0.0."""
    ranks = LowLatencyRanks(2, rows, hidden, dtype, device)
    ranks.partials[0][0, :3] = -0.0
    ranks.expected = reference(ranks.partials, ranks.residuals[0], ranks.weight, 1e-6)
    ranks.inbox(0, 1).copy_(ranks.partials[1])
    outs = [ranks.run(0, programs)]
    assert ranks.empty(0, 1) and not ranks.inbox(1, 0).view(torch.int16).eq(-32768).any()
    torch.testing.assert_close(ranks.inbox(1, 0), ranks.partials[0], atol=0, rtol=0)
    outs.append(ranks.run(1, programs))
    assert ranks.empty(1, 0) and ranks.empty(0, 0) and ranks.empty(1, 1)
    for r in range(2):
        ranks.check(r, outs[r])
    torch.testing.assert_close(ranks.residuals[0], ranks.residuals[1], atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_low_latency_two_ranks_at_the_same_time_many_calls():
    """Two ranks on two streams, each waiting on its inbox for the other's rows, the same inboxes call after call:
    every call right, and the inboxes empty after each (a cell left full would pass stale rows to a later call)."""
    pytest.importorskip("triton")
    streams = [torch.cuda.Stream() for _ in range(2)]
    inboxes = [torch.full((2 * 300 * 1024,), -0.0, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for call, rows in enumerate([1, 5, 64, 37, 300, 2, 128, 300, 1, 77] * 3):
        ranks = LowLatencyRanks(2, rows, 1024, torch.bfloat16, "cuda", seed=call, inboxes=inboxes)
        torch.cuda.synchronize()
        outs = [None, None]
        for r in (1, 0):  # rank 1 first: it waits for rank 0's rows
            with torch.cuda.stream(streams[r]):
                outs[r] = ranks.run(r, programs=64)
        torch.cuda.synchronize()
        for r in range(2):
            ranks.check(r, outs[r])
        assert all(b.view(torch.int16).eq(-32768).all() for b in inboxes)
