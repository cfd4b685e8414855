"""The XQA decode backend's block table (attention/xqa.py), on the CPU: the kernel itself needs a Hopper GPU
(tests/test_gpu.py runs it against HF there), but which pages it reads is plain index arithmetic over the scheduler's
page table, checked here against the slots the torch-native backend attends to in a real run."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.attention.xqa import block_table


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_block_table_lists_each_requests_pages_in_order(page_size):
    g = torch.Generator().manual_seed(page_size)
    lens = [1, page_size, page_size + 1, 5 * page_size - 3, 300]
    num_pages = sum(-(-n // page_size) for n in lens) + 7
    perm = torch.randperm(num_pages, generator=g).tolist()
    page_table = torch.full((8, 320), -1, dtype=torch.int64)
    pages, acc = {}, 0
    for row, n in zip((6, 0, 3, 2, 5), lens):
        k = -(-n // page_size)
        pages[row] = perm[acc : acc + k]
        acc += k
        for i in range(n):
            page_table[row, i] = pages[row][i // page_size] * page_size + i % page_size
    rows = torch.tensor(list(pages))
    width = max(len(p) for p in pages.values())
    table = block_table(page_table, rows, width, page_size)
    assert table.dtype == torch.int32 and table.shape == (len(rows), width)
    for i, row in enumerate(pages):
        assert table[i, : len(pages[row])].tolist() == pages[row]
    # into a larger buffer (CUDA graphs): the rows and columns past the batch stay as they were
    out = torch.full((8, width + 3), 99, dtype=torch.int32)
    block_table(page_table, rows, width, page_size, out)
    assert torch.equal(out[: len(rows), :width], table)
    assert (out[len(rows) :] == 99).all() and (out[:, width:] == 99).all()


def test_block_table_matches_the_slots_a_real_run_attends_to(tiny_model_dir, monkeypatch):
    """Decode batches of a run with pages of 16 (radix cache, shared prefixes, chunked prefill): every slot the
    torch-native backend reads for a request is block[pos // 16] * 16 + pos % 16 of the block table XQA would get."""
    page_size, seen = 16, []
    prepare = TorchNativeBackend.prepare

    def record(self, batch):
        if batch.is_decode:
            rows = torch.tensor([r.table_idx for r in batch.reqs])
            width = -(-max(batch.seq_lens) // page_size)
            table = block_table(self.page_table, rows, width, page_size)
            for i, n in enumerate(batch.seq_lens):
                pos = torch.arange(n)
                expected = self.page_table[rows[i], :n]
                seen.append(torch.equal(table[i, pos // page_size].long() * page_size + pos % page_size, expected))
        return prepare(self, batch)

    monkeypatch.setattr(TorchNativeBackend, "prepare", record)
    llm = LLM(str(tiny_model_dir("llama")), page_size=page_size, max_prefill_tokens=64)
    shared = list(range(10, 80))
    prompts = [shared + [100 + i] * (i + 1) for i in range(6)] + [list(range(200, 203))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    assert len(seen) > 100 and all(seen)
