"""GPU time and KV bandwidth of the paged decode-attention kernels on the throughput workload's shape
(Qwen3-0.6B: 16 query / 8 KV heads x 128, one layer), bf16 and fp8_e4m3 KV:

- FlashInfer's batch decode (CUDA-core, and tensor-core = its prefill kernel), page size 1 and 16;
- `fi_hnd` / `fi_tc_hnd`: the same kernels over pages in the HND layout ([page, kv head, token, dim]: one head's
  tokens of a page contiguous), page sizes of `--page-sizes-hnd`;
- `fa3`: FlashInfer's FlashAttention-3 (Hopper) batch prefill kernel run as a decode (one query row per request),
  page sizes of `--page-sizes-fa3`;
- TensorRT-LLM's XQA kernel as FlashInfer ships it (`trtllm_batch_decode_with_kv_cache(backend="xqa")`,
  page sizes 16/32/64; on Hopper an fp8 cache runs its GMMA kernel, which also rounds q to fp8);
- `ba`: FlashInfer's persistent BatchAttention (KV cut into equal chunks over a persistent grid, merged inside it),
  page sizes of `--page-sizes-ba`;
- `xqa_backend`: the same kernel through minisgl's XqaBackend as the engine runs it (an fp8 cache: XQA's Hopper fp8
  kernel; with MINISGL_XQA_FP8_GMMA=0, its generic kernel over bf16 queries).

Every kernel is checked against float32 attention computed with torch on the same pages (max abs error), and
timed from a CUDA graph of 10 calls (µs per call; TB/s = KV bytes read / time). The KV pages of each request are
scattered over the pool at random, as a long-running server's are.

    python3 tools/device/attn_bench.py [--batches 256,64,8,1] [--only fi,fi_tc,fi_hnd,fi_tc_hnd,xqa,xqa_backend] [--kv
    bf16,fp8]   # after `source tools/device/env.sh`
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

DEV = "cuda"
QH, KVH, D = 16, 8, 128
SCALE = D**-0.5


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - t)


def graph_us(fn, calls: int = 10, reps: int = 5) -> float:
    """µs per call, replayed from a CUDA graph of `calls` calls (eager calls between events if capture fails)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run = g.replay
    except Exception as e:  # noqa: BLE001
        print(f"  (no graph: {e!r:.120}; eager timing)", flush=True)
        torch.cuda.synchronize()

        def run():
            for _ in range(calls):
                fn()

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * reps)


class Case:
    """One batch: seq lens, a pool of pages (random placement), q, and the float32 reference output."""

    def __init__(self, bs: int, ps: int, kv_dtype: torch.dtype, gen: torch.Generator) -> None:
        self.bs, self.ps, self.kv_dtype = bs, ps, kv_dtype
        self.lens = torch.randint(100, 2049, (bs,), generator=gen).tolist()
        self.pages = [-(-n // ps) for n in self.lens]
        total = sum(self.pages)
        self.num_pages = total + 64
        perm = torch.randperm(self.num_pages, generator=gen)[:total].to(torch.int32)
        self.page_ids, acc = [], 0
        for n in self.pages:
            self.page_ids.append(perm[acc : acc + n])
            acc += n
        shape = (self.num_pages, ps, KVH, D)
        k = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        self.k, self.v = k.to(kv_dtype), v.to(kv_dtype)
        self.q = torch.randn(bs, QH, D, device=DEV, dtype=torch.bfloat16)
        self.kv_bytes = sum(self.lens) * KVH * D * 2 * self.k.element_size()
        # float32 reference on the rounded K/V
        kf, vf = self.k.float(), self.v.float()
        refs = []
        for i in range(bs):
            idx = self.page_ids[i].to(DEV).long()
            ki = kf[idx].reshape(-1, KVH, D)[: self.lens[i]]
            vi = vf[idx].reshape(-1, KVH, D)[: self.lens[i]]
            qi = self.q[i].float().view(KVH, QH // KVH, D)
            s = torch.einsum("hgd,nhd->hgn", qi, ki) * SCALE
            refs.append(torch.einsum("hgn,nhd->hgd", s.softmax(-1), vi).reshape(QH, D))
        self.ref = torch.stack(refs)


def flashinfer_decode(
    case: Case,
    workspace: torch.Tensor,
    tensor_cores: bool,
    layout: str = "NHD",
    graph_mode: bool = False,
    split_kv: bool = True,
):
    """graph_mode: the wrapper as the engine's CUDA graphs plan it (use_cuda_graph=True: the KV split into chunks
    and a merge kernel at every batch size, the grid padded); split_kv=False: plan(disable_split_kv=True)."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    indptr = torch.tensor([0] + list(torch.tensor(case.pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.cat(case.page_ids).to(DEV)
    last = torch.tensor([n - (p - 1) * case.ps for n, p in zip(case.lens, case.pages)], dtype=torch.int32)
    buffers = {}
    if graph_mode:
        buffers = dict(
            paged_kv_indptr_buffer=torch.empty_like(indptr, device=DEV),
            paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=last.to(DEV),
        )
    w = BatchDecodeWithPagedKVCacheWrapper(
        workspace, layout, use_tensor_cores=tensor_cores, use_cuda_graph=graph_mode, **buffers
    )
    w.plan(
        indptr,
        indices,
        last,
        QH,
        KVH,
        D,
        case.ps,
        sm_scale=SCALE,
        q_data_type=torch.bfloat16,
        kv_data_type=case.kv_dtype,
        disable_split_kv=not split_kv,
    )
    out = torch.empty(case.bs, QH, D, device=DEV, dtype=torch.bfloat16)
    k, v = case.k, case.v
    if layout == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    return lambda: w.run(case.q, (k, v), out=out), out


def fa3_decode(case: Case, workspace: torch.Tensor, layout: str = "NHD"):
    """FlashInfer's FA3 batch prefill kernel over one query row per request."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    w = BatchPrefillWithPagedKVCacheWrapper(workspace, layout, backend="fa3")
    indptr = torch.tensor([0] + list(torch.tensor(case.pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.cat(case.page_ids).to(DEV)
    last = torch.tensor([n - (p - 1) * case.ps for n, p in zip(case.lens, case.pages)], dtype=torch.int32)
    qo_indptr = torch.arange(case.bs + 1, dtype=torch.int32)
    w.plan(
        qo_indptr,
        indptr,
        indices,
        last,
        QH,
        KVH,
        D,
        case.ps,
        causal=False,
        sm_scale=SCALE,
        q_data_type=torch.bfloat16,
        kv_data_type=case.kv_dtype,
    )
    out = torch.empty(case.bs, QH, D, device=DEV, dtype=torch.bfloat16)
    k, v = case.k, case.v
    if layout == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    return lambda: w.run(case.q, (k, v), out=out), out


def batch_attention(case: Case):
    """FlashInfer's persistent BatchAttention (one kernel for any mix of prefill and decode rows: the KV of the
    batch cut into equal chunks over a persistent grid, the partial results merged inside it)."""
    from flashinfer.attention import BatchAttention

    w = BatchAttention("NHD")
    kv_indptr = torch.tensor([0] + list(torch.tensor(case.pages).cumsum(0).tolist()), dtype=torch.int32)
    w.plan(
        torch.arange(case.bs + 1, dtype=torch.int32, device=DEV),
        kv_indptr.to(DEV),
        torch.cat(case.page_ids).to(DEV),
        torch.tensor(case.lens, dtype=torch.int32, device=DEV),
        QH,
        KVH,
        D,
        D,
        case.ps,
        causal=False,
        sm_scale=SCALE,
        q_data_type=torch.bfloat16,
        kv_data_type=case.kv_dtype,
    )
    out = torch.empty(case.bs, QH, D, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(case.bs, QH, device=DEV, dtype=torch.float32)
    return lambda: w.run(case.q, (case.k, case.v), out=out, lse=lse), out


def xqa_decode(case: Case, workspace: torch.Tensor, pdl: bool | None = None):
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    width = max(case.pages)
    table = torch.zeros(case.bs, width, dtype=torch.int32)
    for i, ids in enumerate(case.page_ids):
        table[i, : len(ids)] = ids
    table = table.to(DEV)
    seq_lens = torch.tensor(case.lens, dtype=torch.int32, device=DEV).view(torch.uint32)
    out = torch.empty(case.bs, QH, D, device=DEV, dtype=torch.bfloat16)

    def fn():
        trtllm_batch_decode_with_kv_cache(
            case.q,
            (case.k, case.v),
            workspace,
            table,
            seq_lens,
            width * case.ps,
            bmm1_scale=SCALE,
            bmm2_scale=1.0,
            out=out,
            kv_layout="NHD",
            backend="xqa",
            enable_pdl=pdl,
        )

    return fn, out


def xqa_backend(case: Case, graph_seq_len: int | None = None):
    """The kernel as minisgl.attention.xqa.XqaBackend calls it; with graph_seq_len, as its CUDA graphs replay it
    (buffers as wide as a graph_seq_len context, the batch padded to the next captured size)."""
    from types import SimpleNamespace

    from minisgl.attention.xqa import XqaBackend

    pool = SimpleNamespace(
        page_size=case.ps,
        num_kv_heads=KVH,
        model_dtype=torch.bfloat16,
        dtype=case.kv_dtype,
        is_fp8=case.kv_dtype != torch.bfloat16,
        paged_k=lambda layer: case.k,
        paged_v=lambda layer: case.v,
    )
    config = SimpleNamespace(num_heads=QH, head_dim=D)
    width = max(case.pages)
    page_table = torch.zeros(case.bs, width * case.ps, dtype=torch.int64)
    for i, ids in enumerate(case.page_ids):
        page_table[i, : len(ids) * case.ps : case.ps] = ids.long() * case.ps
    backend = XqaBackend(config, pool, page_table.to(DEV), DEV)
    batch = SimpleNamespace(
        is_decode=True,
        size=case.bs,
        seq_lens=case.lens,
        reqs=[SimpleNamespace(table_idx=i) for i in range(case.bs)],
    )
    q = case.q
    if graph_seq_len is None:
        backend.prepare(batch)
    else:
        from minisgl.engine.cuda_graph import graph_batch_sizes

        padded = min(n for n in graph_batch_sizes(256) if n >= case.bs)
        backend.init_cuda_graph(256, graph_seq_len, dummy_page=0)
        backend.prepare_replay(batch, padded)
        q = torch.cat([q, q[:1].expand(padded - case.bs, -1, -1)]) if padded > case.bs else q
    out = torch.empty(case.bs, QH, D, device=DEV, dtype=torch.bfloat16)
    return lambda: out.copy_(backend.forward(q, None, None, 0, batch)[: case.bs].view_as(out)), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="256,64,8,1")
    p.add_argument("--only", default="fi,fi_tc,xqa")
    p.add_argument("--page-sizes-xqa", default="16,64")
    p.add_argument("--page-sizes-hnd", default="16,64")
    p.add_argument("--page-sizes-fa3", default="1,16")
    p.add_argument("--page-sizes-ba", default="16")
    p.add_argument("--kv", default="bf16,fp8", help="KV dtypes: bf16, fp8 (e4m3)")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attn_bench.json"))
    p.add_argument("--budget-s", type=float, default=400)
    args = p.parse_args()
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=DEV)
    variants = []
    only = args.only.split(",")
    kv_dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    for kv_dtype in [kv_dtypes[name] for name in args.kv.split(",")]:
        if "fi" in only:
            variants += [("fi", 1, kv_dtype), ("fi", 16, kv_dtype)]
        if "fi_tc" in only:
            variants += [("fi_tc", 1, kv_dtype)]
        for kind in ("fi_hnd", "fi_tc_hnd"):
            if kind in only:
                variants += [(kind, int(ps), kv_dtype) for ps in args.page_sizes_hnd.split(",")]
        if "fa3" in only:
            variants += [("fa3", int(ps), kv_dtype) for ps in args.page_sizes_fa3.split(",")]
        if "xqa" in only:
            variants += [("xqa", int(ps), kv_dtype) for ps in args.page_sizes_xqa.split(",")]
        if "ba" in only:
            variants += [("ba", int(ps), kv_dtype) for ps in args.page_sizes_ba.split(",")]
        if "xqa_backend" in only:
            variants += [("xqa_backend", int(ps), kv_dtype) for ps in args.page_sizes_xqa.split(",")]
    # the xqa variants first at batch 256 so a slow JIT build shows early
    rows = []
    for bs in [int(b) for b in args.batches.split(",")]:
        for kind, ps, kv_dtype in variants:
            if time.time() - t0 > args.budget_s:
                print("budget spent, stopping", flush=True)
                break
            gen = torch.Generator().manual_seed(bs * 7 + ps)
            case = Case(bs, ps, kv_dtype, gen)
            try:
                tb = time.time()
                if kind == "xqa":
                    workspace.zero_()
                    fn, out = xqa_decode(case, workspace)
                elif kind == "xqa_backend":
                    fn, out = xqa_backend(case)
                elif kind == "fa3":
                    fn, out = fa3_decode(case, workspace)
                elif kind == "ba":
                    fn, out = batch_attention(case)
                else:
                    fn, out = flashinfer_decode(
                        case,
                        workspace,
                        tensor_cores=kind.startswith("fi_tc"),
                        layout="HND" if kind.endswith("_hnd") else "NHD",
                    )
                fn()
                torch.cuda.synchronize()
                err = (out.float() - case.ref).abs().max().item()
                us = graph_us(fn)
                row = dict(
                    kind=kind,
                    page_size=ps,
                    kv=str(kv_dtype).split(".")[-1],
                    bs=bs,
                    us=round(us, 1),
                    tbps=round(case.kv_bytes / us / 1e6, 3),
                    of_copy=round(case.kv_bytes / us * 1e6 / bw, 3),
                    max_err=round(err, 4),
                    setup_s=round(time.time() - tb, 1),
                )
            except Exception as e:  # noqa: BLE001 - a kernel that does not build or run is a row too
                row = dict(kind=kind, page_size=ps, kv=str(kv_dtype).split(".")[-1], bs=bs, error=repr(e)[:300])
            print(json.dumps(row), flush=True)
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(dict(copy_tbps=bw / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
