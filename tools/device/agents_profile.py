"""Where a radix agents run's TTFT goes: per step, the host's time by phase and the GPU time of the forward.

Runs `minisgl bench agents`' workload (K agents, T turns) on one in-process scheduler and observes it through the
plugin hooks (minisgl/hooks.py), so no scheduler internals are touched: minisgl_step_scheduled and
minisgl_step_launched give each step's batch, the host's seconds choosing it (schedule) and queuing its forward and
sampling (launch); CUDA events around the launch give the device time; minisgl_request_finished gives each request's
arrival and first token (TTFT). The rest of a step's wall time ("other") is the host reading tokens, finishing
requests and the caller's submits.

    python3 tools/device/agents_profile.py --model <dir> --load-format dummy --device cuda -k 64 -t 6 \
        --max-prefill-tokens 4096 [--cache naive] [--out out/agents_profile.json]

Runs on the CPU too (a tiny model), for the host side.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from minisgl import plugins
from minisgl.bench.agents import Workload, run_workload
from minisgl.config import EngineConfig
from minisgl.hooks import hookimpl
from minisgl.runtime.tp import make_scheduler
from minisgl.scheduler import collector


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--cache", default="radix")
    p.add_argument("-k", "--agents", type=int, default=64)
    p.add_argument("-t", "--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=2000)
    p.add_argument("--tool-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--out", default=None, help="write the summary, the table by step kind and every step as JSON")
    p.add_argument("--sync-debug", action="store_true", help="warn at every CUDA operation that waits for the device")
    one = p.add_mutually_exclusive_group()  # one cProfile at a time
    one.add_argument(
        "--cprofile", action="store_true", help="cProfile the run (slows the host: timings not comparable)"
    )
    one.add_argument("--cprofile-prefill", action="store_true", help="cProfile only the prefill launches")
    one.add_argument(
        "--cprofile-between",
        action="store_true",
        help="cProfile the host before each burst's first prefill: from the previous step's launch (reading tokens, "
        "finishing requests, the submits) to the prefill batch chosen (the admission)",
    )
    p.add_argument(
        "--sleep-probe",
        action="store_true",
        help="queue a 30 ms GPU sleep before each prefill: a phase whose host time includes it waits for the GPU",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="torch.profiler over each prefill launch (synchronized around it): GPU kernels by total time",
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
    return p.parse_args(argv)


class StepProfiler:
    """The plugin: one record per step from the step hooks, TTFT from the finished requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = False
        self.steps: list[dict[str, Any]] = []
        self.requests: dict[str, tuple[float, float]] = {}  # rid -> (arrival, first token), time.perf_counter
        self.prefill_prof = cProfile.Profile()
        self.between: cProfile.Profile | None = None
        self.between_profiles: list[cProfile.Profile] = []
        self.kernel_us: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        self.prefill_kernel_us: list[float] = []
        self._torch_prof: Any = None
        self.ref_event: Any = None  # CUDA event at the run's start: the origin of every step's GPU span

    def reset(self) -> None:
        """Forget the warm-up."""
        self.steps.clear()
        self.requests.clear()

    @hookimpl
    def minisgl_step_scheduled(self, batch: Any, schedule_s: float) -> None:
        now = time.perf_counter()
        prefill = batch.is_prefill
        if self.between is not None:
            self.between.disable()
            if prefill and (not self.steps or not self.steps[-1]["prefill"]):
                self.between_profiles.append(self.between)
            self.between = None
        start = None
        if self.cuda:
            if self.args.sleep_probe and prefill:
                torch.cuda._sleep(50_000_000)  # ~30 ms at an H100's clock
            if self.args.kernels and prefill:
                self._kernels_start()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if self.args.cprofile_prefill and prefill:
            self.prefill_prof.enable()
        step = {"prefill": prefill, "reqs": batch.size, "tokens": sum(batch.extend_lens)}
        self.steps.append(step | {"t": now - schedule_s, "schedule_s": schedule_s, "events": (start, None)})

    @hookimpl
    def minisgl_step_launched(self, batch: Any, launch_s: float) -> None:
        step = self.steps[-1]
        step["launch_s"] = launch_s
        if self.args.cprofile_prefill and batch.is_prefill:
            self.prefill_prof.disable()
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            step["events"] = (step["events"][0], end)
            if self._torch_prof is not None:
                self._kernels_stop()
        if self.args.cprofile_between:
            self.between = cProfile.Profile()
            self.between.enable()

    @hookimpl
    def minisgl_request_finished(self, req: Any) -> None:
        if req.first_token_time:
            self.requests[req.rid] = (req.arrival, req.first_token_time)

    def _kernels_start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._torch_prof = profile(activities=[ProfilerActivity.CUDA])
        self._torch_prof.start()

    def _kernels_stop(self) -> None:
        from torch.autograd import DeviceType

        torch.cuda.synchronize()
        self._torch_prof.stop()
        total = 0.0
        for evt in self._torch_prof.events():
            if evt.device_type == DeviceType.CUDA:
                us = evt.time_range.elapsed_us()
                row = self.kernel_us[evt.name]
                row[0] += us
                row[1] += 1
                total += us
        self.prefill_kernel_us.append(total)
        self._torch_prof = None


class GcWatch:
    """Python's collections during the run (gc.callbacks): start, end, generation."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self._start = 0.0

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((self._start, time.perf_counter(), info["generation"]))


def run(args: argparse.Namespace, prof: StepProfiler) -> tuple[dict[str, Any], GcWatch, float]:
    """Build the scheduler with the plugin registered, warm up, run the workload; (summary, gc, GPU time origin)."""
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
    plugins.get_plugin_manager().register(prof, name="agents-profile")  # before the scheduler looks hooks up
    sched = make_scheduler(config)
    prof.cuda = sched.device.type == "cuda"
    vocab = sched.model_config.vocab_size
    if sched.tokenizer is not None:
        vocab = min(vocab, len(sched.tokenizer))
    run_workload(sched, Workload.make(vocab, 1, 1, 16, 4, 2, 1))
    prof.reset()
    work = Workload.make(vocab, args.agents, args.turns, args.system_len, args.tool_len, args.output_len, 0)
    if prof.cuda:
        torch.cuda.synchronize()
        prof.ref_event = torch.cuda.Event(enable_timing=True)
        prof.ref_event.record()
    t_ref = time.perf_counter()
    if args.sync_debug:
        import warnings

        warnings.simplefilter("default")
        torch.cuda.set_sync_debug_mode("warn")
    if args.cprofile:
        prof.prefill_prof.enable()
    if not args.auto_gc:
        collector.take_over()  # as `minisgl bench agents` and the daemon's scheduler process do
    with GcWatch() as gcw:
        stats = run_workload(sched, work)
    collector.release()
    prof.prefill_prof.disable()
    if prof.between is not None:
        prof.between.disable()
    if prof.cuda:
        torch.cuda.synchronize()
    return stats.summary(), gcw, t_ref


def finish_steps(prof: StepProfiler, t_ref: float) -> dict[str, dict[str, float]]:
    """Each step's wall (to the next step's start), GPU time and span; totals by step kind."""
    steps = prof.steps
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, s in enumerate(steps):
        kind = "prefill" if s["prefill"] else ("decode<=16" if s["reqs"] <= 16 else "decode")
        row = by_kind[kind]
        row["steps"] += 1
        row["tokens"] += s["tokens"]
        row["schedule_s"] += s["schedule_s"]
        row["launch_s"] += s.get("launch_s", 0.0)
        start, end = s.pop("events")
        if start is not None and end is not None:
            s["gpu_s"] = start.elapsed_time(end) / 1000
            row["gpu_s"] += s["gpu_s"]
            ref = prof.ref_event
            s["gpu_rel"] = (t_ref + ref.elapsed_time(start) / 1000, t_ref + ref.elapsed_time(end) / 1000)
        if i + 1 < len(steps):  # the last step has no wall: its host work after the launch is the run's end
            s["wall_s"] = steps[i + 1]["t"] - s["t"]
            row["wall_s"] += s["wall_s"]
            row["other_s"] += s["wall_s"] - s["schedule_s"] - s.get("launch_s", 0.0)
    return by_kind


def print_kinds(by_kind: dict[str, dict[str, float]]) -> None:
    print(
        f"{'kind':12s} {'steps':>6s} {'tokens':>8s} {'wall s':>8s} {'gpu s':>8s} {'schedule s':>11s} "
        f"{'launch s':>9s} {'other s':>8s} {'ms/step wall':>13s} {'ms/step gpu':>12s}"
    )
    for kind, r in by_kind.items():
        n = max(1, r["steps"])
        print(
            f"{kind:12s} {r['steps']:6.0f} {r['tokens']:8.0f} {r['wall_s']:8.3f} {r.get('gpu_s', 0):8.3f} "
            f"{r['schedule_s']:11.3f} {r['launch_s']:9.3f} {r['other_s']:8.3f} {1000 * r['wall_s'] / n:13.2f} "
            f"{1000 * r.get('gpu_s', 0) / n:12.2f}"
        )


def print_ttft(prof: StepProfiler, gcw: GcWatch) -> None:
    pauses = gcw.pauses
    print(
        f"gc: {len(pauses)} collections, {1000 * sum(b - a for a, b, _ in pauses):.1f} ms in all; by generation "
        + str({g: sum(1 for *_, x in pauses if x == g) for g in (0, 1, 2)})
    )
    turns: dict[int, list[float]] = defaultdict(list)
    for rid, (arrival, first) in prof.requests.items():
        if "-turn" in rid:
            turns[int(rid.rsplit("-turn", 1)[1])].append(1000 * (first - arrival))
    print(
        "TTFT by turn (ms): "
        + "; ".join(
            f"turn {k}: n {len(v)} p50 {np.percentile(v, 50):.1f} p99 {np.percentile(v, 99):.1f} min {min(v):.1f}"
            for k, v in sorted(turns.items())
        )
    )


def print_kernels(prof: StepProfiler) -> None:
    if not prof.kernel_us:
        return
    total = sum(v[0] for v in prof.kernel_us.values())
    n = len(prof.prefill_kernel_us)
    print(
        f"prefill forwards: {n}, GPU kernel time {total / 1000:.1f} ms "
        f"({total / 1000 / max(1, n):.2f} ms a prefill step); kernels by total time:"
    )
    for name, (us, calls) in sorted(prof.kernel_us.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {us / 1000:9.2f} ms {100 * us / total:5.1f}% {calls:7d}x  {name[:110]}")


def step_line(s: dict[str, Any], t0: float, firsts: int | None = None) -> str:
    """One step: kind, tokens, requests, host start and phases (ms from t0), GPU span."""
    g0, g1 = s.get("gpu_rel", (float("nan"), float("nan")))
    line = (
        f"  {'P' if s['prefill'] else 'D'} {s['tokens']:6d} tok {s['reqs']:3d} req  host {1000 * (s['t'] - t0):8.2f} "
        f"schedule {1000 * s['schedule_s']:6.2f} launch {1000 * s.get('launch_s', 0):6.2f} "
        f"wall {1000 * s.get('wall_s', 0):7.2f}  gpu {1000 * (g0 - t0):8.2f} .. {1000 * (g1 - t0):8.2f}"
    )
    return line + (f"  firsts {firsts:3d}" if firsts is not None else "")


def print_timeline(prof: StepProfiler, gcw: GcWatch, turn: int) -> None:
    reqs = {rid: v for rid, v in prof.requests.items() if rid.endswith(f"-turn{turn}")}
    if not reqs:
        return
    t0 = min(a for a, _ in reqs.values())
    t1 = max(f for _, f in reqs.values())
    print(
        f"turn {turn}: submits over {1000 * (max(a for a, _ in reqs.values()) - t0):.2f} ms; steps from the first "
        "submit (ms from it: host start and phases, gpu start .. end; first tokens read in the step)"
    )
    firsts = sorted(f for _, f in reqs.values())
    for a, b, gen in gcw.pauses:
        if t0 - 0.05 <= a <= t1:
            print(f"  gc gen {gen} at {1000 * (a - t0):8.2f} for {1000 * (b - a):.2f} ms")
    for s in prof.steps:
        if t0 - 0.05 <= s["t"] <= t1 + 0.001:
            end = s["t"] + s.get("wall_s", 0.0)
            print(step_line(s, t0, sum(1 for f in firsts if s["t"] <= f < end)))


def print_burst(prof: StepProfiler) -> None:
    """The third burst's prefill steps one by one (the first if fewer): a burst's TTFT is their sum."""
    bursts: list[list[dict[str, Any]]] = []
    previous = False
    for s in prof.steps:
        if s["prefill"]:
            if not previous:
                bursts.append([])
            bursts[-1].append(s)
        previous = s["prefill"]
    if not bursts:
        return
    burst = bursts[2] if len(bursts) > 2 else bursts[-1]
    print(f"prefill steps of burst {bursts.index(burst)} ({len(bursts)} bursts), ms from its first step's start:")
    for s in burst:
        print(step_line(s, burst[0]["t"]))


def print_profiles(prof: StepProfiler) -> None:
    groups = []
    if prof.args.cprofile or prof.args.cprofile_prefill:
        groups.append(("the run" if prof.args.cprofile else "prefill launches", [prof.prefill_prof]))
    if prof.between_profiles:
        groups.append(
            (f"host before a burst's first prefill ({len(prof.between_profiles)} profiles)", prof.between_profiles)
        )
    for title, profiles in groups:
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(*profiles, stream=buf).sort_stats(order).print_stats(30)
            print(f"{title}, by {order}:\n" + buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prof = StepProfiler(args)
    try:
        summary, gcw, t_ref = run(args, prof)
    finally:
        plugins.get_plugin_manager().unregister(name="agents-profile")
    by_kind = finish_steps(prof, t_ref)
    print_ttft(prof, gcw)
    print_kernels(prof)
    print(json.dumps(summary))
    print_kinds(by_kind)
    for turn in args.timeline or ([2] if args.timeline is not None else []):
        print_timeline(prof, gcw, turn)
    print_burst(prof)
    print_profiles(prof)
    if args.out:
        ttft = {rid: first - arrival for rid, (arrival, first) in prof.requests.items()}
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "by_kind": by_kind, "steps": prof.steps, "ttft_s": ttft}, f, default=float)


if __name__ == "__main__":
    main()
