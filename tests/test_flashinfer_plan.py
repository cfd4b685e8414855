"""The host side of FlashInfer's graph-mode decode plans (attention/flashinfer.py), without a GPU.

A graph planned without a KV split launches more blocks than the batch has rows and gives the extra ones no mask
(flashinfer 0.5.3): they run whatever request indices sit past the batch's in the pinned buffer the plan copies
from. _GraphPadding writes those entries before each plan; the GPU tests replay such graphs
(tests/test_gpu.py::test_outputs_identical_with_and_without_cuda_graphs_and_overlap, 136 rows).
On a GPU with flashinfer, the replans of a graph's wrapper (_replan_graph) are checked against flashinfer's own plan().
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import pytest
import torch

from minisgl.attention.flashinfer import FlashInferBackend, _GraphPadding, graph_split_kv


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


def _graph_wrapper(bs: int, max_pages: int, heads: tuple[int, int, int], ps: int) -> object:
    """A graph-mode tensor-core decode wrapper of bs rows, planned once on one-token rows as at capture."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    dev = torch.device("cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 * 2**20, dtype=torch.uint8, device=dev),
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev),
    )
    wrapper._int_workspace_buffer.zero_()  # compared whole: nothing left from an earlier allocation
    wrapper._pin_memory_int_workspace_buffer.zero_()
    indices = torch.zeros(bs, dtype=torch.int32, device=dev)
    wrapper.plan(
        torch.arange(bs + 1, dtype=torch.int32), indices, torch.ones(bs, dtype=torch.int32), *heads, ps,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, disable_split_kv=not graph_split_kv(bs),
    )  # fmt: skip
    return wrapper


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None, reason="needs CUDA and flashinfer"
)
@pytest.mark.parametrize("bs", [4, 31, 32, 136, 256])
def test_graph_replan_leaves_what_flashinfers_plan_leaves(bs):
    heads, ps = (16, 2, 128), 16  # q heads, KV heads, head dim
    rng = random.Random(bs)
    seq_lens = [rng.randrange(1, 3000) for _ in range(bs - 3)] + [1, 1, 1]  # the last rows as graph padding
    num_pages = [-(-s // ps) for s in seq_lens]
    indptr = torch.tensor([0] + [sum(num_pages[: i + 1]) for i in range(bs)], dtype=torch.int32)
    last = torch.tensor([s - (n - 1) * ps for s, n in zip(seq_lens, num_pages)], dtype=torch.int32)
    indices = torch.randint(0, 50_000, (sum(num_pages),), dtype=torch.int32, device="cuda")
    split = graph_split_kv(bs)
    reference, replanned = (_graph_wrapper(bs, 200 * bs, heads, ps) for _ in range(2))
    reference.plan(
        indptr, indices, last, *heads, ps,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, disable_split_kv=not split,
    )  # fmt: skip
    backend = SimpleNamespace(
        _qo_indptr=torch.arange(1, dtype=torch.int32),
        num_qo_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=heads[2],
        page_size=ps,
    )
    FlashInferBackend._replan_graph(backend, replanned, indptr, indices, last, seq_lens, split_kv=split)
    torch.cuda.synchronize()
    assert [int(x) for x in replanned._plan_info] == [int(x) for x in reference._plan_info]
    assert replanned._max_kv_len == reference._max_kv_len == max(seq_lens)
    for name in ("_int_workspace_buffer", "_pin_memory_int_workspace_buffer", "_paged_kv_indptr_buf",
                 "_paged_kv_last_page_len_buf", "_paged_kv_indices_buf"):  # fmt: skip
        assert torch.equal(getattr(replanned, name).cpu(), getattr(reference, name).cpu()), name


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_ids_are_each_requests_pages_in_order(page_size):
    """The gathered page ids equal page_table[row, 0:seq_len:page_size] // page_size per request, concatenated."""
    rng = random.Random(page_size)
    rows, width = 6, 40
    table = torch.randint(0, 1000, (rows, width), dtype=torch.int64) * page_size  # page-aligned slots
    backend = SimpleNamespace(page_size=page_size, page_table=table, device=torch.device("cpu"))
    picked = rng.sample(range(rows), 4)
    seq_lens = [rng.randrange(1, width + 1) for _ in picked]
    num_pages = [-(-s // page_size) for s in seq_lens]
    got = FlashInferBackend._page_ids(backend, picked, num_pages)
    want = torch.cat([table[r, 0:s:page_size] // page_size for r, s in zip(picked, seq_lens)])
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()
