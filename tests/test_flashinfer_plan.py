"""The host side of FlashInfer's graph-mode decode plans (attention/flashinfer.py), without a GPU.

A graph planned without a KV split launches more blocks than the batch has rows and gives the extra ones no mask
(flashinfer 0.5.3): they run whatever request indices sit past the batch's in the pinned buffer the plan copies
from. _GraphPadding writes those entries before each plan; the GPU tests replay such graphs
(tests/test_gpu.py::test_outputs_identical_with_and_without_cuda_graphs_and_overlap, 136 rows).
"""

from __future__ import annotations

import pytest
import torch

from minisgl.attention.flashinfer import _GraphPadding, graph_split_kv


def plan_info(padded: int, split_kv: int = 0) -> list[int]:
    """A PrefillPlanInfo vector as flashinfer's plan returns it: three int32[padded] arrays 16-byte aligned."""
    aligned = -(-4 * padded // 16) * 16
    return [padded, 0, 0, 16, 0, aligned, 2 * aligned, 0, 3 * aligned, 3 * aligned + 16, 0, 0, 0, 1, split_kv]


@pytest.mark.parametrize(("bs", "padded"), [(9, 12), (256, 287), (40, 40)])
def test_padding_points_the_extra_blocks_at_one_row_and_leaves_the_batch_alone(bs, padded):
    info = plan_info(padded)
    pinned = torch.full((4096,), 0xAB, dtype=torch.uint8)
    before = pinned.clone()
    _GraphPadding(info, bs).fill(pinned, row=3)
    for offset, value in zip(info[4:7], (3, 0, 0)):
        arr = pinned[offset : offset + 4 * padded].view(torch.int32)
        assert (arr[bs:] == value).all()  # request 3, q tile 0, KV tile 0
        assert torch.equal(arr[:bs], before[offset : offset + 4 * padded].view(torch.int32)[:bs])  # the plan's own
    written = torch.zeros(4096, dtype=torch.bool)
    for offset in info[4:7]:
        written[offset + 4 * bs : offset + 4 * padded] = True
    assert torch.equal(pinned[~written], before[~written])  # nothing else touched


def test_padding_refuses_a_plan_with_a_kv_split_or_another_layout():
    with pytest.raises(AssertionError, match="unexpected FlashInfer plan layout"):
        _GraphPadding(plan_info(12, split_kv=1), 9)  # a split plan masks its padded blocks itself
    with pytest.raises(AssertionError, match="unexpected FlashInfer plan layout"):
        _GraphPadding(plan_info(12)[:14], 9)


def test_decode_graphs_split_the_kv_below_32_rows_only():
    assert [bs for bs in (1, 8, 31, 32, 64, 256) if graph_split_kv(bs)] == [1, 8, 31]
