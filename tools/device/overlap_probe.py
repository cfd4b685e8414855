"""Is there time to win by running a decode batch as two micro-batches on two CUDA streams (NanoFlow's idea)?

At batch ~256 a decode step of the throughput workload is ~7.2 ms of memory-bound attention and ~1.7 ms of GEMMs,
norms and small kernels, back to back. Two halves of the batch on two streams could run one half's GEMMs while the
other half's attention reads the KV, at the price of reading the weights twice. This probe measures it on the
engine's own model and backend, GPU time only (CUDA events around graph replays, no scheduler):

- one:    the engine's captured decode graph of the whole batch (what runs today);
- halves: two graphs of half the batch, one after the other (the cost of splitting alone);
- two streams (equal priority, or the second stream at high priority): one graph holding both halves' forwards
  on two streams, joined at the end.

Sequence lengths are uniform in 100-2,048, pages scattered over the pool, as tools/device/attn_bench.py.

    python3 tools/device/overlap_probe.py --model-dir <dummy Qwen3-0.6B dir> [--batches 256,128,64]
"""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import torch


def timed_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batches", default="256,192,128,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from minisgl import LLM
    from minisgl.attention.flashinfer import FlashInferBackend
    from minisgl.core import Batch, Phase, get_context

    llm = LLM(args.model_dir, dtype="bfloat16", load_format="dummy", max_prefill_tokens=16384)
    eng = llm.scheduler.engine
    model, pool, table, dev = eng.model, eng.kv_pool, eng.table.page_table, eng.device
    assert eng.page_size == 1 and type(eng.attn_backend) is FlashInferBackend, "probe expects the bf16 default"
    ctx = get_context()
    rng = random.Random(0)
    weight = model.lm_head.weight
    results = []

    def make_batch(rows: list[int], lens: list[int], out_loc: torch.Tensor) -> Batch:
        bs = len(rows)
        return Batch(
            reqs=[SimpleNamespace(table_idx=r) for r in rows], phase=Phase.DECODE,  # type: ignore[misc]
            input_ids=torch.randint(0, 10000, (bs,), device=dev), positions=torch.tensor([n - 1 for n in lens], device=dev),
            out_loc=out_loc, table_rows=torch.tensor(rows, device=dev), prefix_lens=[n - 1 for n in lens],
            extend_lens=[1] * bs, seq_lens=lens, sample_mask=[True] * bs, padded_size=bs,
        )

    for bs in [int(b) for b in args.batches.split(",")]:
        half = bs // 2
        lens = [rng.randint(100, 2048) for _ in range(bs)]
        perm = torch.randperm(eng.num_pages, device=dev)
        at = 0
        for r, n in enumerate(lens):
            table[r, :n] = perm[at : at + n]
            at += n
        out_loc = perm[at : at + bs].clone()
        per_token = 2 * pool.buffer.shape[1] * pool.num_kv_heads * pool.head_dim * pool.buffer.element_size()
        kv_bytes = sum(lens) * per_token
        row = {"batch": bs}

        # one: the engine's graph of the whole batch
        runner = eng.graph_runner
        full = make_batch(list(range(bs)), lens, out_loc)
        ctx.attn_backend = eng.attn_backend
        runner.run(full)
        row["one_ms"] = timed_ms(runner.graphs[runner.padded_size(bs)].replay)

        # two backends, one per half, each with its own workspace and graph buffers
        backends, batches, bufs = [], [], []
        for h in range(2):
            rows = list(range(h * half, (h + 1) * half))
            be = FlashInferBackend(eng.model_config, pool, table, dev)
            be.init_cuda_graph(half, eng.max_seq_len, eng.num_pages)
            be.capture_metadata(half)
            b = make_batch(rows, lens[h * half : (h + 1) * half], out_loc[h * half : (h + 1) * half].clone())
            be.prepare_replay(b, half)
            backends.append(be)
            batches.append(b)
            bufs.append(torch.empty(half, weight.shape[0], dtype=weight.dtype, device=dev))

        def forward_half(h: int) -> None:
            ctx.attn_backend = backends[h]
            with ctx.forward_batch(batches[h]):
                hidden = model(batches[h].input_ids, batches[h].positions)
            torch.mm(hidden, weight.t(), out=bufs[h])

        with torch.inference_mode():
            for h in range(2):
                forward_half(h)
            torch.cuda.synchronize()
            halves = []
            for h in range(2):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    forward_half(h)
                halves.append(g)
            row["halves_ms"] = timed_ms(lambda: (halves[0].replay(), halves[1].replay()))
            row["half_alone_ms"] = timed_ms(halves[0].replay)
            for name, prio in (("two_streams_ms", 0), ("two_streams_hi_ms", -1)):
                side = torch.cuda.Stream(priority=prio)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)
                    forward_half(0)
                    with torch.cuda.stream(side):
                        forward_half(1)
                    main.wait_stream(side)
                row[name] = timed_ms(g.replay)
                del g
        ctx.attn_backend = eng.attn_backend
        row["kv_gb"] = round(kv_bytes / 1e9, 2)
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print("RESULT", json.dumps(row), flush=True)
        results.append(row)
        del backends, batches, bufs, halves
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
