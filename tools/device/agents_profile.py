"""Where a radix agents run's TTFT goes: per step, host time by phase and the GPU time of the forward.

Runs `minisgl bench agents`' workload (K agents, T turns) on one in-process scheduler and wraps the
scheduler's verbs with timers: prefill admission, decode admission, launch (plan + kernel launches),
process (waiting for the step's tokens, then the host bookkeeping). Each forward gets CUDA events, so
the table shows host and device time per step kind; a cProfile of the run lists the host's hot spots.

    python3 tools/device/agents_profile.py --model <dir> --load-format dummy --device cuda -k 64 -t 6 \
        --max-prefill-tokens 4096 [--cache naive] [--out out/agents_profile.json]

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

import numpy as np
import torch

from minisgl.bench.agents import Workload, run_workload
from minisgl.config import EngineConfig
from minisgl.scheduler import collector
from minisgl.scheduler.tp import make_scheduler

CURRENT: dict[str, float] = defaultdict(float)
SCHEDULE_CALLS = (
    "gc",
    "extends",
    "add",
    "schedule",
    "_lock_waiting_prefixes",
    "_ordered_waiting",
    "admit",
    "reserve",
    "make_batch",
    "cache_prefix",
    "prepare",
    "forward",
)  # the step being launched: host seconds per wrapped call


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
    p.add_argument(
        "--cprofile", action="store_true", help="cProfile the run (slows the host: timings are not comparable)"
    )
    p.add_argument(
        "--cprofile-prefill", action="store_true", help="cProfile only the prefill forwards (launch + sampling)"
    )
    p.add_argument(
        "--cprofile-burst",
        action="store_true",
        help="cProfile only the host between turns: the step() that finishes requests, the submits, "
        "up to the end of the next prefill launch",
    )
    p.add_argument(
        "--cprofile-schedule",
        action="store_true",
        help="cProfile the prefill admissions that rank 32 or more waiting requests (a burst's first chunks)",
    )
    p.add_argument(
        "--sleep-probe",
        action="store_true",
        help="queue a 30 ms GPU sleep before each prefill: a call whose host time includes it waits for the GPU",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="torch.profiler over each prefill forward (synchronized after it): GPU kernels by total time",
    )
    p.add_argument(
        "--auto-gc",
        action="store_true",
        help="leave Python's collector automatic (the bench and the daemon run it at the scheduler's safe point)",
    )
    p.add_argument(
        "--timeline",
        type=int,
        nargs="*",
        default=None,
        help="print every step from the first submit of these turns (default 2) to their last first token",
    )
    args = p.parse_args()

    config = EngineConfig(
        model=args.model,
        cache=args.cache,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_running_requests=256,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_cache_gb=args.kv_cache_gb,
        attention_backend=args.attention_backend,
    )
    sched = make_scheduler(config)
    vocab = sched.model_config.vocab_size
    if sched.tokenizer is not None:
        vocab = min(vocab, len(sched.tokenizer))
    run_workload(sched, Workload.make(vocab, 1, 1, 16, 4, 2, 1))
    work = Workload.make(vocab, args.agents, args.turns, 2000, 200, 100, 0)

    totals: dict[str, float] = defaultdict(float)
    schedule_profiles: list[cProfile.Profile] = []
    in_schedule = [False]
    gc_in_schedule: list[float] = []
    if args.cprofile_schedule:
        schedule = sched.prefill.schedule

        def schedule_profiled(*a: Any, **k: Any) -> Any:
            if len(sched.prefill.waiting) < 32:
                return schedule(*a, **k)
            prof_s = cProfile.Profile()
            in_schedule[0] = True
            prof_s.enable()
            try:
                return schedule(*a, **k)
            finally:
                prof_s.disable()
                in_schedule[0] = False
                schedule_profiles.append(prof_s)

        sched.prefill.schedule = schedule_profiled
    wrap(sched.prefill, "schedule", totals)
    wrap(sched.prefill, "_ordered_waiting", totals)
    wrap(sched.prefill, "_lock_waiting_prefixes", totals)
    wrap(sched.kv, "admit", totals)
    wrap(sched.kv, "reserve", totals)
    from minisgl.scheduler.prefill import BatchPrefixes

    wrap(BatchPrefixes, "extends", totals)
    wrap(BatchPrefixes, "add", totals)
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
        steps.append(
            {
                "prefill": batch.is_prefill,
                "reqs": batch.size,
                "tokens": sum(batch.extend_lens),
                "launch_host_s": host,
                "events": (start, end),
                "t": t0,
                "calls": dict(CURRENT),
            }
        )
        return out

    def launch_ending_burst(batch: Any) -> Any:
        out = launch_with_events(batch)
        if burst[0] is not None and batch.is_prefill:
            burst[0].disable()
            burst_profiles.append(burst[0])
            burst[0] = None
        return out

    sched._launch = launch_ending_burst
    submitted_at: dict[str, float] = {}
    first_at: dict[str, float] = {}
    add_request, step = sched.add_request, sched.step

    add_spans: list[tuple[float, float]] = []
    step_calls: list[tuple[float, float, int, int]] = []  # start, end, outputs, finished
    gc_pauses: list[tuple[float, float, int]] = []  # start, end, generation
    gc_start = [0.0]

    def add_request_timed(rid: str, *a: Any, **k: Any) -> Any:
        submitted_at[rid] = t = time.perf_counter()
        try:
            return add_request(rid, *a, **k)
        finally:
            add_spans.append((t, time.perf_counter()))

    burst_profiles: list[cProfile.Profile] = []
    burst: list[cProfile.Profile | None] = [None]

    def step_timed() -> Any:
        CURRENT.clear()  # a step's calls: scheduling it, then launching it
        t = time.perf_counter()
        own = None
        if args.cprofile_burst and burst[0] is None:
            own = cProfile.Profile()
            own.enable()
        outs = step()
        if own is not None:
            own.disable()
            if any(o.finished for o in outs):
                burst_profiles.append(own)
                burst[0] = cProfile.Profile()
                burst[0].enable()
        now = time.perf_counter()
        step_calls.append((t, now, len(outs), sum(1 for o in outs if o.finished)))
        for out in outs:
            if out.new_token_ids and out.rid not in first_at:
                first_at[out.rid] = now
        return outs

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append((gc_start[0], time.perf_counter(), info["generation"]))
            CURRENT["gc"] += time.perf_counter() - gc_start[0]
            if in_schedule[0]:
                gc_in_schedule.append(time.perf_counter() - gc_start[0])

    import gc

    gc.callbacks.append(on_gc)

    sched.add_request, sched.step = add_request_timed, step_timed
    kernel_us: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    prefill_kernel_us: list[float] = []
    if args.kernels:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        timed_launch = sched._launch

        def launch_profiled(batch: Any) -> Any:
            if not batch.is_prefill:
                return timed_launch(batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof_k:
                out = timed_launch(batch)
                torch.cuda.synchronize()
            total = 0.0
            for evt in prof_k.events():
                if evt.device_type == DeviceType.CUDA:
                    us = evt.time_range.elapsed_us()
                    row = kernel_us[evt.name]
                    row[0] += us
                    row[1] += 1
                    total += us
            prefill_kernel_us.append(total)
            return out

        sched._launch = launch_profiled
    ref_event = None
    if cuda:
        torch.cuda.synchronize()
        ref_event = torch.cuda.Event(enable_timing=True)
        ref_event.record()
    t_ref = time.perf_counter()
    if args.sync_debug:
        import warnings

        warnings.simplefilter("default")
        torch.cuda.set_sync_debug_mode("warn")
    if args.cprofile:
        prof.enable()
    if not args.auto_gc:
        collector.take_over()  # as `minisgl bench agents` and the daemon's scheduler process do
    stats = run_workload(sched, work)
    collector.release()
    prof.disable()
    gc.callbacks.remove(on_gc)
    print(
        f"gc: {len(gc_pauses)} collections, {1000 * sum(b - a for a, b, _ in gc_pauses):.1f} ms in all; by generation "
        + str({g: sum(1 for *_, x in gc_pauses if x == g) for g in (0, 1, 2)})
    )
    if cuda:
        torch.cuda.synchronize()
    if kernel_us:
        total = sum(v[0] for v in kernel_us.values())
        print(
            f"prefill forwards: {len(prefill_kernel_us)}, GPU kernel time {total / 1000:.1f} ms "
            f"({total / 1000 / max(1, len(prefill_kernel_us)):.2f} ms a prefill step); kernels by total time:"
        )
        for name, (us, n) in sorted(kernel_us.items(), key=lambda kv: -kv[1][0])[:30]:
            print(f"  {us / 1000:9.2f} ms {100 * us / total:5.1f}% {n:7d}x  {name[:110]}")
    turns: dict[int, list[float]] = defaultdict(list)
    for rid, t in first_at.items():
        if rid in submitted_at and "-turn" in rid:
            turns[int(rid.rsplit("-turn", 1)[1])].append(1000 * (t - submitted_at[rid]))
    print(
        "TTFT by turn (ms): "
        + "; ".join(
            f"turn {k}: n {len(v)} p50 {np.percentile(v, 50):.1f} p99 {np.percentile(v, 99):.1f} min {min(v):.1f}"
            for k, v in sorted(turns.items())
        )
    )
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
            s["gpu_rel"] = (t_ref + ref_event.elapsed_time(start) / 1000, t_ref + ref_event.elapsed_time(end) / 1000)
        if i + 1 < len(steps):
            s["wall_s"] = steps[i + 1]["t"] - s["t"]
            row["wall_s"] += s["wall_s"]
    print(json.dumps(summary))
    print(
        f"{'kind':12s} {'steps':>6s} {'tokens':>8s} {'wall s':>8s} {'gpu s':>8s} {'launch host s':>14s} "
        f"{'ms/step wall':>13s} {'ms/step gpu':>12s}"
    )
    for kind, r in by_kind.items():
        n = max(1, r["steps"])
        print(
            f"{kind:12s} {r['steps']:6.0f} {r['tokens']:8.0f} {r['wall_s']:8.3f} {r.get('gpu_s', 0):8.3f} "
            f"{r['launch_host_s']:14.3f} {1000 * r['wall_s'] / n:13.2f} {1000 * r.get('gpu_s', 0) / n:12.2f}"
        )
    for turn in (args.timeline if args.timeline is not None else []) or ([2] if args.timeline is not None else []):
        rids = [r for r in submitted_at if r.endswith(f"-turn{turn}")]
        if not rids:
            continue
        t0 = min(submitted_at[r] for r in rids)
        t1 = max(first_at.get(r, t0) for r in rids)
        print(
            f"turn {turn}: submits over {1000 * (max(submitted_at[r] for r in rids) - t0):.2f} ms; steps from the "
            f"first "
            f"submit (ms: host launch start, host launch ms, gpu start, gpu end; first tokens returned by that step())"
        )
        firsts = sorted(first_at[r] for r in rids if r in first_at)
        spans = [(a, b) for a, b in add_spans if t0 <= a <= t1]
        print(
            f"  add_request: {len(spans)} calls, {1000 * sum(b - a for a, b in spans):.2f} ms in all, "
            f"longest {1000 * max((b - a for a, b in spans), default=0):.2f} ms"
        )
        for a, b, gen in gc_pauses:
            if t0 - 0.05 <= a <= t1:
                print(f"  gc gen {gen} at {1000 * (a - t0):8.2f} for {1000 * (b - a):.2f} ms")
        for a, b, n_out, n_fin in step_calls:
            if t0 - 0.05 <= b <= t1 + 0.001:
                print(f"  step() {1000 * (a - t0):8.2f} .. {1000 * (b - t0):8.2f}: {n_out} outputs, {n_fin} finished")
        for s_ in steps:
            if not (t0 - 0.05 <= s_["t"] <= t1 + 0.001):
                continue
            g0 = g1 = float("nan")
            if s_.get("gpu_rel") is not None:
                g0, g1 = s_["gpu_rel"]
            end = s_["t"] + s_.get("wall_s", 0)
            n_first = sum(1 for f in firsts if s_["t"] <= f < end) if "wall_s" in s_ else 0
            kind = "P" if s_["prefill"] else "D"
            print(
                f"  {kind} {s_['tokens']:6d} tok {s_['reqs']:3d} req  host {1000 * (s_['t'] - t0):8.2f} "
                f"+{1000 * s_['launch_host_s']:6.2f}"
                f"  gpu {1000 * (g0 - t0):8.2f} .. {1000 * (g1 - t0):8.2f}  firsts {n_first:3d}"
                + (
                    "  "
                    + " ".join(
                        f"{k.split('.')[-1]} {1000 * v:.1f}"
                        for k, v in s_["calls"].items()
                        if k.split(".")[-1] in SCHEDULE_CALLS
                    )
                    if s_["prefill"]
                    else ""
                )
            )
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
    for i in bursts[2] if len(bursts) > 2 else bursts[-1]:
        s = steps[i]
        print(
            f"  {s['tokens']:6d} {s['reqs']:4d} {1000 * s.get('wall_s', 0):8.2f} {1000 * s.get('gpu_s', 0):8.2f} "
            f"{1000 * s['launch_host_s']:8.2f}  " + " ".join(f"{k} {1000 * v:.2f}" for k, v in s["calls"].items())
        )
    if args.cprofile or args.cprofile_prefill:
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(35)
            print(buf.getvalue())
    if schedule_profiles:
        print(
            f"gc inside the profiled admissions: {len(gc_in_schedule)} collections, {1000 * sum(gc_in_schedule):.1f} ms"
        )
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(*schedule_profiles, stream=buf).sort_stats(order).print_stats(30)
            print(
                f"prefill admissions of 32+ waiting ({len(schedule_profiles)} profiles), by {order}:\n" + buf.getvalue()
            )
    if burst_profiles:
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(*burst_profiles, stream=buf).sort_stats(order).print_stats(30)
            print(f"host between turns ({len(burst_profiles)} profiles), by {order}:\n" + buf.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "by_kind": by_kind, "host_totals": totals, "steps": steps}, f, default=float)


if __name__ == "__main__":
    main()
