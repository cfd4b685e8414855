"""Decode attention over the throughput workload's own batches, integrated over the run, per kernel and page layout.

tools/device/attn_bench.py times one layer on sequence lengths uniform in 100-2,048 with every page placed at
random; the run (issue 8's workload) is different: at decode step t the batch holds the requests with more than t
tokens to go, each of prompt + t tokens, the prompt's pages contiguous (one prefill) and the decode pages
interleaved across requests (one page per request as it fills). This script replays that allocation for a page
size, takes the batches of every `--every`-th decode step, times each kernel on them (one layer, CUDA graph of
10 calls) and sums time x steps represented x 28 layers: an estimate of the run's decode-attention seconds to set
against `minisgl bench profile gpu --whole-run` (FlashInfer's CUDA-core decode, pages of 1: 5.12 s).

    python3 tools/device/attn_workload.py [--configs fi:1,fi_tc:1,fi_tc_hnd:64,fi_tc_g:16,fi_tc_g_ns:16,xqa:64]
    [--every 50]

`_g`: FlashInfer's wrapper in CUDA-graph mode, as the engine replays it (the KV split and merged at every batch
size); `_ns`: planned with disable_split_kv=True; `_lf` / `_sf` (any kernel): each batch ordered longest / shortest
request first instead of the requests' order of arrival; `ba`: FlashInfer's persistent BatchAttention; `xqa_np`: XQA
launched without programmatic dependent
launch; `xqab` [`_g`]: XQA as minisgl's XqaBackend calls it [from its CUDA-graph buffers]; `_pool` / `_pool2`: K and V
views into a whole model's pool
laid out (2, layers, ...) as minisgl's KVPool / (layers, 2, ...); `_cold`: consecutive calls read two layers' K and V in
turn (as the engine's layers do), so no call finds the previous call's last reads in the L2 cache.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from attn_bench import (
    DEV,
    KVH,
    QH,
    D,
    batch_attention,
    fa3_decode,
    flashinfer_decode,
    graph_us,
    xqa_backend,
    xqa_decode,
)  # noqa: E402

LAYERS = 28
MAX_SEQ_LEN = 40960  # the dummy model's context (minisgl.bench.throughput): the width of the engine's graph buffers


def snapshots(ps: int, every: int) -> tuple[int, list[tuple[int, int, list[int], list[list[int]]]]]:
    """(pages in the pool, [(step, steps represented, lens, page ids per request)]) of the workload's decode."""
    from minisgl.bench.throughput import workload

    prompts, max_tokens = workload()
    lens = [len(p) for p in prompts]
    pages: list[list[int]] = []
    nxt = 0
    for n in lens:  # the prefill: each prompt's pages in one run
        k = -(-n // ps)
        pages.append(list(range(nxt, nxt + k)))
        nxt += k
    out = []
    last = max(max_tokens)
    for t in range(1, last):  # decode step t samples token t + 1 of the requests with max_tokens > t
        active = [i for i in range(len(prompts)) if max_tokens[i] > t]
        for i in active:
            if lens[i] + t > len(pages[i]) * ps:  # this step's token opens a page
                pages[i].append(nxt)
                nxt += 1
        if t % every == 1 or every == 1:
            out.append((t, min(every, last - t), [lens[i] + t for i in active], [list(pages[i]) for i in active]))
    return nxt, out


def kernel(kind: str, tags: set[str], case: SimpleNamespace, workspace: torch.Tensor):
    """A call of the config's kernel on one batch."""
    if kind.startswith("xqab"):
        return xqa_backend(case, graph_seq_len=MAX_SEQ_LEN if "g" in tags else None)[0]
    if kind.startswith("xqa"):
        workspace.zero_()
        return xqa_decode(case, workspace, pdl=False if "np" in tags else None)[0]
    if kind.startswith("ba"):
        return batch_attention(case)[0]
    if kind.startswith("fa3"):
        return fa3_decode(case, workspace)[0]
    # fi, fi_tc [+ _hnd] [+ _g: graph-mode wrapper, as the engine's graphs] [+ _ns: no KV split]
    return flashinfer_decode(
        case,
        workspace,
        tensor_cores="tc" in tags,
        layout="HND" if "hnd" in tags else "NHD",
        graph_mode="g" in tags,
        split_kv="ns" not in tags,
    )[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--configs", default="fi:1,fi_tc:1,fi:16,fi_tc:16,fi_tc_hnd:16,fi_tc:64,fi_tc_hnd:64,fi_hnd:64,xqa:64"
    )
    p.add_argument("--every", type=int, default=50)
    args = p.parse_args()
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=DEV)
    by_ps: dict[int, tuple[int, list]] = {}
    for config in args.configs.split(","):
        kind, ps = config.split(":")[0], int(config.split(":")[1])
        if ps not in by_ps:
            by_ps[ps] = snapshots(ps, args.every)
        num_pages, snaps = by_ps[ps]
        tags = set(kind.split("_"))
        gen = torch.Generator(device=DEV).manual_seed(0)
        pool = None
        if {"pool", "pool2"} & tags:
            # K and V inside a whole model's pool, as the engine holds them: (2, layers, slots, ...) (KVPool's
            # layout) or, for "pool2", (layers, 2, slots, ...); the kernel reads a middle layer's.
            shape = (2, LAYERS) if "pool" in tags else (LAYERS, 2)
            pool = torch.empty(shape + ((num_pages + 1) * ps, KVH, D), device=DEV, dtype=torch.bfloat16)
            kv = (pool[0, LAYERS // 2], pool[1, LAYERS // 2]) if shape[0] == 2 else tuple(pool[LAYERS // 2])
            k, v = (x.view(num_pages + 1, ps, KVH, D) for x in kv)
            k.normal_(generator=gen)
            v.normal_(generator=gen)
        else:
            k = torch.randn((num_pages + 1, ps, KVH, D), device=DEV, dtype=torch.bfloat16, generator=gen)
            v = torch.randn((num_pages + 1, ps, KVH, D), device=DEV, dtype=torch.bfloat16, generator=gen)
        other = (torch.randn_like(k), torch.randn_like(v)) if "cold" in tags else None
        total_s, total_bytes, t0, per_bs = 0.0, 0, time.time(), []
        for step, weight, lens, page_lists in snaps:
            if {"lf", "sf"} & tags:
                order = sorted(range(len(lens)), key=lambda i: -lens[i] if "lf" in tags else lens[i])
                lens, page_lists = [lens[i] for i in order], [page_lists[i] for i in order]
            case = SimpleNamespace(
                bs=len(lens),
                ps=ps,
                kv_dtype=torch.bfloat16,
                lens=lens,
                pages=[len(x) for x in page_lists],
                page_ids=[torch.tensor(x, dtype=torch.int32) for x in page_lists],
                k=k,
                v=v,
                q=torch.randn(len(lens), QH, D, device=DEV, dtype=torch.bfloat16, generator=gen),
            )
            cases = [case]
            if other is not None:  # the same batch over a second layer's K and V, called in turn with the first
                cases.append(copy.copy(case))
                cases[1].k, cases[1].v = other
            fns = [kernel(kind, tags, c, workspace) for c in cases]
            turn = itertools.cycle(fns)
            us = graph_us(fns[0] if len(fns) == 1 else lambda: next(turn)())
            nbytes = sum(lens) * KVH * D * 2 * 2
            total_s += us * 1e-6 * weight * LAYERS
            total_bytes += nbytes * weight * LAYERS
            per_bs.append(f"{case.bs}:{nbytes / us / 1e6:.2f}")
        print(
            f"{config:14s} run estimate {total_s:6.3f} s, {total_bytes / total_s / 1e12:5.3f} TB/s "
            f"({time.time() - t0:4.1f} s); TB/s by batch: {' '.join(per_bs)}",
            flush=True,
        )
        del k, v, pool, other
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
