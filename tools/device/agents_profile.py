"""Where a radix agents run's TTFT goes: per step, host time by phase and the GPU time of the forward.

Runs `minisgl bench agents`' workload (K agents, T turns) on one in-process scheduler and wraps the
scheduler's verbs with timers: prefill admission, decode admission, launch (plan + kernel launches),
process (waiting for the step's tokens, then the host bookkeeping). Each forward gets CUDA events, so
the table shows host and device time per step kind; a cProfile of the run lists the host's hot spots.

    python3 tools/device/agents_profile.py --model <dir> --load-format dummy --device cuda -k 64 -t 6 \
        --max-prefill-tokens 4096 [--cache naive] [--out $OUT/agents_profile.json]

Runs on the CPU too (a tiny model), for the host side.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from typing import Any

import torch

from minisgl.bench.agents import Workload, run_workload
from minisgl.config import EngineConfig
from minisgl.scheduler.tp import make_scheduler


CURRENT: dict[str, float] = defaultdict(float)  # the step being launched: host seconds per wrapped call


def wrap(obj: Any, name: str, totals: dict[str, float]) -> None:
    fn = getattr(obj, name)
    key = name if name in ("schedule", "_launch", "_process", "copy_to_host") else f"{type(obj).__name__}.{name}"

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            totals[key] += dt
            CURRENT[key] += dt

    setattr(obj, name, timed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--cache", default="radix")
    p.add_argument("-k", "--agents", type=int, default=64)
    p.add_argument("-t", "--turns", type=int, default=6)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--out", default=None)
    p.add_argument("--sync-debug", action="store_true", help="warn at every CUDA operation that waits for the device")
    p.add_argument("--cprofile", action="store_true", help="cProfile the run (slows the host: timings are not comparable)")
    p.add_argument("--cprofile-prefill", action="store_true", help="cProfile only the prefill forwards (launch + sampling)")
    p.add_argument("--sleep-probe", action="store_true",
                   help="queue a 30 ms GPU sleep before each prefill: a call whose host time includes it waits for the GPU")
    p.add_argument("--kernels", action="store_true", help="torch.profiler over the run: GPU kernels by total time")
    args = p.parse_args()

    config = EngineConfig(
        model=args.model, cache=args.cache, device=args.device, dtype=args.dtype, load_format=args.load_format,
        max_running_requests=256, max_prefill_tokens=args.max_prefill_tokens, kv_cache_gb=args.kv_cache_gb,
        attention_backend=args.attention_backend,
    )
    sched = make_scheduler(config)
    vocab = sched.model_config.vocab_size
    if sched.tokenizer is not None:
        vocab = min(vocab, len(sched.tokenizer))
    run_workload(sched, Workload.make(vocab, 1, 1, 16, 4, 2, 1))
    work = Workload.make(vocab, args.agents, args.turns, 2000, 200, 100, 0)

    totals: dict[str, float] = defaultdict(float)
    wrap(sched.prefill, "schedule", totals)
    wrap(sched.prefill, "_ordered_waiting", totals)
    prof = cProfile.Profile()
    if args.cprofile_prefill:
        forward_and_sample = sched.engine.forward_and_sample

        def profiled(batch: Any, *a: Any, **k: Any) -> Any:
            if not batch.is_prefill:
                return forward_and_sample(batch, *a, **k)
            prof.enable()
            try:
                return forward_and_sample(batch, *a, **k)
            finally:
                prof.disable()

        sched.engine.forward_and_sample = profiled
    wrap(sched.engine, "forward_and_sample", totals)
    wrap(sched.engine, "forward", totals)
    wrap(sched.engine.model, "forward", totals)
    wrap(sched.engine.sampler, "sample", totals)
    wrap(sched.engine.attn_backend, "prepare", totals)
    wrap(sched.kv, "cache_prefix", totals)
    wrap(sched.kv, "make_batch", totals)
    import minisgl.scheduler.scheduler as scheduler_module

    wrap(scheduler_module, "copy_to_host", totals)
    wrap(sched, "_launch", totals)
    wrap(sched, "_process", totals)
    cuda = sched.device.type == "cuda"
    steps: list[dict[str, Any]] = []
    launch = sched._launch

    def launch_with_events(batch: Any) -> Any:
        start = end = None
        CURRENT.clear()
        if cuda and args.sleep_probe and batch.is_prefill:
            torch.cuda._sleep(50_000_000)  # ~30 ms at the H100's clock
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = launch(batch)
        host = time.perf_counter() - t0
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        steps.append({"prefill": batch.is_prefill, "reqs": batch.size, "tokens": sum(batch.extend_lens),
                      "launch_host_s": host, "events": (start, end), "t": t0, "calls": dict(CURRENT)})
        return out

    sched._launch = launch_with_events
    kernels = None
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        kernels = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        kernels.__enter__()
    if args.sync_debug:
        import warnings

        warnings.simplefilter("default")
        torch.cuda.set_sync_debug_mode("warn")
    if args.cprofile:
        prof.enable()
    stats = run_workload(sched, work)
    prof.disable()
    if kernels is not None:
        kernels.__exit__(None, None, None)
        print(kernels.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    if cuda:
        torch.cuda.synchronize()
    summary = stats.summary()

    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, s in enumerate(steps):
        kind = "prefill" if s["prefill"] else ("decode<=16" if s["reqs"] <= 16 else "decode")
        row = by_kind[kind]
        row["steps"] += 1
        row["tokens"] += s["tokens"]
        row["launch_host_s"] += s["launch_host_s"]
        start, end = s.pop("events")
        if start is not None:
            s["gpu_s"] = start.elapsed_time(end) / 1000
            row["gpu_s"] += s["gpu_s"]
        if i + 1 < len(steps):
            s["wall_s"] = steps[i + 1]["t"] - s["t"]
            row["wall_s"] += s["wall_s"]
    print(json.dumps(summary))
    print(f"{'kind':12s} {'steps':>6s} {'tokens':>8s} {'wall s':>8s} {'gpu s':>8s} {'launch host s':>14s} {'ms/step wall':>13s} {'ms/step gpu':>12s}")
    for kind, r in by_kind.items():
        n = max(1, r["steps"])
        print(f"{kind:12s} {r['steps']:6.0f} {r['tokens']:8.0f} {r['wall_s']:8.3f} {r.get('gpu_s', 0):8.3f} "
              f"{r['launch_host_s']:14.3f} {1000 * r['wall_s'] / n:13.2f} {1000 * r.get('gpu_s', 0) / n:12.2f}")
    print("host totals (s): " + ", ".join(f"{k} {v:.3f}" for k, v in totals.items()))
    # The first bursts' prefill steps one by one: the TTFT of a burst is the sum of these.
    print("prefill steps of turn 2's burst (tokens, reqs, wall ms, gpu ms, launch host ms):")
    prefills = [i for i, s in enumerate(steps) if s["prefill"]]
    bursts, cur = [], []
    for i in prefills:
        if cur and i != cur[-1] + 1:
            bursts.append(cur)
            cur = []
        cur.append(i)
    bursts.append(cur)
    for i in (bursts[2] if len(bursts) > 2 else bursts[-1]):
        s = steps[i]
        print(f"  {s['tokens']:6d} {s['reqs']:4d} {1000 * s.get('wall_s', 0):8.2f} {1000 * s.get('gpu_s', 0):8.2f} {1000 * s['launch_host_s']:8.2f}  "
              + " ".join(f"{k} {1000 * v:.2f}" for k, v in s["calls"].items()))
    if args.cprofile or args.cprofile_prefill:
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(35)
            print(buf.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "by_kind": by_kind, "host_totals": totals, "steps": steps}, f, default=float)


if __name__ == "__main__":
    main()
