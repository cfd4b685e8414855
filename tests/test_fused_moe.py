"""The fused MoE Triton path (layers/fused_moe.py: routing kernel, grouping by expert, grouped GEMMs) against
layers/moe.py's plain PyTorch loop over the experts, and over a range of the experts (expert parallelism) against
a dense float32 loop over every token's routed experts.

On a CUDA machine it runs compiled; on any machine with Triton it also runs in Triton's interpreter
(TRITON_INTERPRET=1, numpy on the CPU) in a fresh process (see tests/triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import interpreter_or_cuda, run_interpreter_cases


def test_the_kernels_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=15, timeout=900)


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-interpreter", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    interpreter_or_cuda(request.param)
    return request.param


@pytest.fixture(params=[True, False], ids=["one-launch", "three-kernels"])
def grouping(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """align_by_expert's two ways: a program per expert in one launch (decode's few pairs) or three kernels
    (prefill's many)."""
    from minisgl.layers import fused_moe

    monkeypatch.setattr(fused_moe, "ONE_LAUNCH_PAIRS", fused_moe.ONE_LAUNCH_PAIRS if request.param else 0)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"),
    [(37, 8, 2, False), (5, 16, 4, True), (70, 6, 3, True), (200, 4, 4, True)],
    ids=[
        "37-tokens-8-experts-top2",
        "5-tokens-16-experts-top4",
        "70-tokens-6-experts-top3",
        "200-tokens-4-experts-top4-prefill-tiles",
    ],
)
def test_fused_moe_matches_the_expert_loop(device, grouping, tokens, experts, top_k, renormalize):
    """Same experts, same routing weights; float32 in the interpreter, bf16 on a GPU (tolerance to match)."""
    from minisgl.layers.fused_moe import fused_moe, route_topk
    from minisgl.layers.moe import experts_loop, route

    hidden, inter = 64, 48
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    ref_w, ref_ids = route(logits, top_k, renormalize)
    ref = experts_loop(x, ref_w, ref_ids, gate_up, down)
    to = dict(device=device, dtype=dtype)
    w, ids = route_topk(logits.to(device), top_k, renormalize)
    assert torch.equal(ids.cpu().long(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, atol=1e-6, rtol=1e-5)
    got = fused_moe(x.to(**to), logits.to(device), gate_up.to(**to), down.to(**to), top_k, renormalize)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol)


def test_grouping_pads_each_experts_rows_to_the_block(device, grouping):
    """Every (token, slot) pair appears once, in its expert's block run; padding rows name no pair."""
    from minisgl.layers.fused_moe import align_by_expert

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (29, 2), generator=g).to(device=device, dtype=torch.int32)
    sorted_ids, block_expert, total = (t.cpu() for t in align_by_expert(ids, 8, 16))
    flat = ids.flatten().cpu()
    used = sorted_ids[: int(total)]
    pairs = used[used < flat.numel()]
    assert sorted(pairs.tolist()) == list(range(flat.numel()))
    for block in range(int(total) // 16):
        rows = sorted_ids[block * 16 : (block + 1) * 16]
        real = rows[rows < flat.numel()].long()
        assert len(real) > 0 and (flat[real] == block_expert[block]).all()
    assert sorted_ids.numel() % 16 == 0 and (sorted_ids[int(total) :] == flat.numel()).all()


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "first", "local"),
    [(37, 8, 2, 4, 4), (11, 6, 3, 0, 2), (9, 8, 2, 2, 2)],
    ids=["37-tokens-experts-4-to-8-of-8", "11-tokens-experts-0-to-2-of-6-top3", "9-tokens-experts-2-to-4-of-8"],
)
def test_fused_moe_over_an_expert_range_sums_only_those_experts(device, tokens, experts, top_k, first, local):
    """A rank holding experts [first, first + local) of all of them: each token gets the weighted sum over those of
    its routed experts only (zero if none is there), written over every row of the buffer it is given."""
    from minisgl.layers.fused_moe import fused_moe

    hidden, inter = 64, 48
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(tokens + first)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    ref = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if first <= e < first + local:
                gate, up = (gate_up[e] @ x[t]).chunk(2)
                ref[t] += weights[t, k] * (down[e] @ (F.silu(gate) * up))
    assert (ref == 0).all(dim=1).any() and (ref != 0).any(dim=1).any()  # tokens with and without local experts
    to = dict(device=device, dtype=dtype)
    mine = slice(first, first + local)
    out = torch.full((tokens, hidden), float("nan"), **to)
    got = fused_moe(
        x.to(**to), logits.to(device), gate_up[mine].to(**to), down[mine].to(**to), top_k, True, out=out,
        expert_offset=first,
    )  # fmt: skip
    assert got is out
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol)


def test_grouping_over_an_expert_range_leaves_the_other_experts_pairs_out(device, grouping):
    """Experts 3..5 of 8: their pairs appear once each, in their (local) expert's blocks; no other pair appears."""
    from minisgl.layers.fused_moe import align_by_expert

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (29, 2), generator=g).to(device=device, dtype=torch.int32)
    sorted_ids, block_expert, total = (t.cpu() for t in align_by_expert(ids, 3, 16, expert_offset=3))
    flat = ids.flatten().cpu()
    used = sorted_ids[: int(total)]
    local = ((flat >= 3) & (flat < 6)).nonzero().flatten()
    assert 0 < len(local) < flat.numel()
    assert sorted(used[used < flat.numel()].tolist()) == local.tolist()
    for block in range(int(total) // 16):
        rows = sorted_ids[block * 16 : (block + 1) * 16]
        real = rows[rows < flat.numel()].long()
        assert len(real) > 0 and (flat[real] == block_expert[block] + 3).all()
    assert (sorted_ids[int(total) :] == flat.numel()).all()


def test_one_compiled_kernel_serves_every_batch_size():
    """Token counts of one block configuration, odd and even: the grouped GEMM and the grouping compile once for
    all of them (a count specialised on compiles again, ~1 s, the first time a batch of the other parity comes)."""
    if not torch.cuda.is_available():
        pytest.skip("compiles for a CUDA GPU")
    from minisgl.layers import fused_moe as fm

    hidden, inter, experts = 72, 40, 8  # sizes no other test compiles for
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to("cuda", torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to("cuda", torch.bfloat16)
    kernels = (fm._gemm_kernel(), fm._grouping_kernels()[3])

    def compiled() -> list[int]:
        return [sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels]

    counts = []
    for tokens in (200, 201, 207, 224):  # 400, 402, 414, 448 pairs at top-2: one configuration (block_config)
        x = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
        fm.fused_moe(x, torch.randn(tokens, experts, generator=g).cuda(), gate_up, down, 2, True)
        counts.append(compiled())
    assert counts[1:] == counts[:1] * 3, counts
