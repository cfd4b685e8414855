"""Where the time goes: CPU GEMM throughput per backend, a profile of one CPU decode step, GPU decode steps.

    minisgl bench profile cpu-gemm     # GFLOP/s of F.linear (MKL) vs oneDNN, plain and packed weight
    minisgl bench profile cpu-step     # SmolLM2 fp32: one batch-32 decode step replayed, then profiled
    minisgl bench profile gpu [--shape S] [--quantization fp8] [--disable-overlap] [--disable-cuda-graph]

`cpu-gemm` uses SmolLM2's shapes (hidden 576, qkv 960, gate_up 3072, down 1536 -> 576, LM head 49,152)
at decode (1-64 rows) and prefill (256-3,183 rows) sizes. `cpu-step` runs the offline benchmark's 32
prompts for 48 tokens, keeps the 30th decode batch and calls Engine.forward on it again (idempotent:
it rewrites the same KV slots), timing 40 replays and profiling 10 with torch.profiler. Each replay
is a steady decode step: the attention backend's dense KV copy is told it holds everything but the
batch's new tokens, so it appends them (`--rebuild`: every replay rebuilds the copy from the pool,
as the first step after the batch changed does).

`gpu` runs the 256-request workload of `minisgl bench throughput` (a dummy model of its `--shape`, Qwen3-0.6B's by
default, bf16 or `--quantization fp8`; `--batch-one`: one request instead) step by step, after 32 of its requests
warmed every kernel, and reports the whole run's time by forward kind (prefill; decode by batch size, each bucket
beside its floor: its steps' bytes at copy bandwidth, bench/roofline.py's step_floor), wall time per step and the
time the host waits for the GPU (event syncs) over stretches of the run, the GPU kernels by total time over 20 steps
at batch ~256 and 20 steps of the tail (torch.profiler), the host's Python hot spots (cProfile), a roofline of each
profiled decode window (bench/roofline.py: per kernel class the GPU time, launches, bytes and FLOPs against the
measured copy bandwidth and bf16 rate), and with `--whole-run` every kernel of a second, profiled pass. `--tp 2`:
the same on two GPUs, rank 0 profiled (each rank's floor: half the bytes), without the roofline tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams, env
from minisgl.bench import roofline
from minisgl.bench.throughput import SHAPES as MODEL_SHAPES
from minisgl.bench.throughput import workload, write_model_dir

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out) features


def sorted_seconds(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Wall time of reps calls of fn after warmup calls, fastest first."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def gemm(rows: list[int]) -> None:
    print(f"{'rows':>5} {'in x out':>11}  {'F.linear':>9} {'oneDNN':>9} {'packed':>9}  GFLOP/s (best of reps)")
    for m in rows:
        for k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            reps = 100 if m <= 64 else 8
            figures = [
                2 * m * k * n / sorted_seconds(fn, reps)[0] / 1e9
                for fn in (
                    lambda: F.linear(x, w),
                    lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                )
            ]
            print(f"{m:>5} {k:>5}x{n:<5}  " + " ".join(f"{f:>9.1f}" for f in figures), flush=True)


def step(model: str, replays: int, rebuild: bool) -> None:
    from torch.profiler import ProfilerActivity, profile  # lazy: torch, when the benchmark runs

    from minisgl.bench.offline import make_prompts  # lazy: torch, when the benchmark runs
    from minisgl.engine.engine import Engine  # lazy: torch, when the benchmark runs

    decode_batches = []
    forward = Engine.forward

    def keep(self: Engine, batch: object) -> torch.Tensor:
        if batch.is_decode:  # type: ignore[attr-defined]
            decode_batches.append(batch)
        return forward(self, batch)

    llm = LLM(model)
    Engine.forward = keep  # type: ignore[method-assign]
    try:
        llm.generate(
            make_prompts(llm.model_config.vocab_size, 32, 128, 0),
            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        Engine.forward = forward  # type: ignore[method-assign]
    batch, engine = decode_batches[30], llm.scheduler.engine
    mirror = engine.attn_backend.mirror

    def replay() -> None:
        if not rebuild:  # the copy holds all but the new token of every request: this step appends
            mirror.rows, mirror.seq_lens = [r.table_idx for r in batch.reqs], [s - 1 for s in batch.seq_lens]
        engine.forward(batch)

    times = sorted_seconds(replay, replays, warmup=1)
    print(
        f"decode step, batch {batch.size}: best {times[0] * 1e3:.1f} ms, median {times[len(times) // 2] * 1e3:.1f} ms"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            replay()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


def _dummy_llm(args: argparse.Namespace) -> Any:
    """An LLM over the throughput bench's model shape with dummy weights, configured from the command line."""
    return LLM(
        str(write_model_dir(Path(args.tokenizer_dir), args.shape)),
        dtype="bfloat16",
        load_format="dummy",
        quantization=args.quantization,
        max_prefill_tokens=args.max_prefill_tokens,
        disable_overlap=args.disable_overlap,
        disable_cuda_graph=args.disable_cuda_graph,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        tp=args.tp,
    )


def gpu(args: argparse.Namespace) -> None:
    peak = roofline.peaks()  # before the engine sizes its KV pool from the free memory
    with _dummy_llm(args) as llm:  # held for the whole run: it owns the engine the scheduler drives
        _profile_run(args, llm, peak)


def _profile_run(args: argparse.Namespace, llm: Any, peak: roofline.Peaks) -> None:
    sched = llm.scheduler
    local = getattr(sched, "sched", sched)  # under TP: rank 0's own scheduler (the other ranks mirror its steps)
    # --batch-one: one request (a 128-token prompt, 512 new tokens), so that every decode step has batch 1
    prompts, max_tokens = ([list(range(1000, 1128))], [512]) if args.batch_one else workload()

    def submit(tag: str) -> None:
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
            sched.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True))

    waited = [0.0]
    sync = torch.cuda.Event.synchronize

    def timed_sync(self: torch.cuda.Event) -> None:
        t0 = time.perf_counter()
        sync(self)
        waited[0] += time.perf_counter() - t0

    kind: list[tuple[bool, int] | None] = [None]  # this step's forward: (prefill, tokens or rows), None: none
    launch = local.engine.forward_and_sample

    events: list[tuple[torch.cuda.Event, torch.cuda.Event] | None] = [None]  # this step's forward + sampling on the GPU

    def recording_launch(batch, sampled, bitmask_fn=None):  # type: ignore[no-untyped-def]
        kind[0] = (batch.is_prefill, sum(batch.extend_lens) if batch.is_prefill else batch.size)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = launch(batch, sampled, bitmask_fn)
        end.record()
        events[0] = (begin, end)
        return out

    _warm(llm)
    local.engine.forward_and_sample = recording_launch  # type: ignore[method-assign]
    torch.cuda.Event.synchronize = timed_sync  # type: ignore[method-assign]
    submit("r")
    walls, waits, sizes, kinds, spans, windows, kv_tokens = [], [], [], [], [], {}, []
    starts: dict[str, int] = {}
    num_steps, tail_at = 0, None
    t_start = time.perf_counter()
    while sched.has_work:
        num_steps += 1
        if tail_at is None and num_steps > 200 and len(local.running) <= 16:
            tail_at = num_steps
        _profile_windows(num_steps, tail_at, starts, windows)
        if num_steps == 170:
            cpu = cProfile.Profile()
            cpu.enable()
        if num_steps == 190:
            cpu.disable()
        waited[0], kind[0], events[0] = 0.0, None, None
        t0 = time.perf_counter()
        sched.step()
        walls.append(time.perf_counter() - t0)
        waits.append(waited[0])
        sizes.append(len(local.running))
        kv_tokens.append(sum(req.seq_len for req in local.running))
        kinds.append(kind[0])
        spans.append(events[0])
    total = time.perf_counter() - t_start
    torch.cuda.Event.synchronize = sync  # type: ignore[method-assign]

    shape, fp8 = MODEL_SHAPES[args.shape], args.quantization == "fp8"
    floors = [  # each decode step's bytes at copy bandwidth (its requests' KV: the running ones' after the step);
        # under TP each rank reads 1/tp of them (its shard of the weights and of the KV heads)
        0.0 if what is None or what[0] else roofline.step_floor(shape, what[1], kv, peak.copy_bytes_s, fp8) / args.tp
        for what, kv in zip(kinds, kv_tokens)
    ]
    torch.cuda.synchronize()
    gpu_s = [span[0].elapsed_time(span[1]) / 1000 if span is not None else 0.0 for span in spans]
    steps = _StepRecord(kinds, kv_tokens, walls, gpu_s, floors)
    _report_steps(num_steps, total, steps, waits, sizes)
    _report_profiles(windows, cpu)
    if args.tp == 1:  # the roofline's bytes are the whole model's
        _report_rooflines(starts, windows, steps, shape, peak, fp8)
    if args.whole_run:  # the same workload again (prefix cache emptied first), every kernel of it profiled
        _profile_whole_run(sched, submit)


def _warm(llm: Any) -> None:
    """32 requests of the workload (every kernel built, every decode graph replayed), the prefix cache emptied after
    them: the measured run starts from there."""
    prompts, max_tokens = workload(32)
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()


def _profile_windows(step: int, tail_at: int | None, starts: dict[str, int], windows: dict[str, Any]) -> None:
    """Open or close the torch.profiler windows at this step (1-based): the first 10 prefill steps, 20 decode steps
    at batch ~256 from step 150, and 20 of the tail from tail_at."""
    for name, begin, length in (
        ("prefill, the first 10 steps", 1, 10),
        ("20 decode steps, bs ~256", 150, 20),
        ("20 decode steps, the tail, bs <= 16", tail_at, 20),
    ):
        if begin is not None and step == begin:
            starts[name] = begin
            windows[name] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            windows[name].__enter__()
        elif begin is not None and step == begin + length:
            windows[name].__exit__(None, None, None)


class _StepRecord(NamedTuple):
    """Per step (0-based): the forward's kind, the running requests' KV tokens, wall and GPU seconds, and a decode
    step's floor (its bytes at copy bandwidth; 0 for a prefill)."""

    kinds: list[tuple[bool, int] | None]
    kv_tokens: list[int]
    walls: list[float]
    gpu_s: list[float]
    floors: list[float]


def _report_rooflines(
    starts: dict[str, int], windows: dict[str, Any], steps: _StepRecord, shape: dict, peak: roofline.Peaks, fp8: bool
) -> None:
    """bench/roofline.py's table for each profiled window of decode steps (steps begin .. begin + 19, 1-based)."""
    for name, begin in starts.items():
        if name.startswith("prefill"):
            continue
        span = slice(begin - 1, begin + 19)
        rows = [kind[1] for kind in steps.kinds[span] if kind is not None and not kind[0]]
        window = roofline.Window(
            name,
            windows[name],
            steps=20,
            batch=sum(rows) / max(1, len(rows)),
            kv_tokens=sum(steps.kv_tokens[span]) / 20,
            wall_s=sum(steps.walls[span]) / 20,
            gpu_s=sum(steps.gpu_s[span]) / 20,
        )
        roofline.report(window, shape, peak, fp8)


def _report_steps(
    num_steps: int,
    total: float,
    steps: _StepRecord,
    waits: list[float],
    sizes: list[int],
) -> None:
    """Per-step wall, host waits, GPU time and the floor's share of the wall, bucketed by the forward's kind and
    batch size."""
    kinds, walls, gpu_s = steps.kinds, steps.walls, steps.gpu_s
    # Steps whose launch ran a forward; the step's wall is the host loop's, with overlap about the previous
    # step's GPU time. Buckets by the batch size of the forward (decode) or "prefill".
    print(f"\n{num_steps} steps in {total:.2f}s")
    print(
        f"GPU busy {sum(gpu_s):.2f}s (from each forward's first kernel to its sampling's last), "
        f"idle {total - sum(gpu_s):.2f}s"
    )
    buckets: dict[str, list[float]] = {}
    for what, wall, wait, busy, floor in zip(kinds, walls, waits, gpu_s, steps.floors):
        if what is None:
            key, n = "no forward", 0
        else:
            key, n = "prefill", what[1]
            if not what[0]:
                key = next(f"decode bs <= {b}" for b in (8, 32, 64, 128, 192, 256, 10**9) if n <= b)
        b = buckets.setdefault(key, [0, 0.0, 0.0, 0, 0.0, 0.0])
        b[0], b[1], b[2], b[3], b[4], b[5] = b[0] + 1, b[1] + wall, b[2] + wait, b[3] + n, b[4] + busy, b[5] + floor
    print(
        f"{'forward':18s} {'steps':>6s} {'seconds':>8s} {'share':>6s} {'ms/step':>8s} {'GPU ms/step':>11s} "
        f"{'host waits ms':>13s} {'rows':>9s} {'floor s':>8s} {'of wall':>7s}"
    )
    for key in sorted(
        buckets, key=lambda k: (k.startswith("decode"), int(k.split()[-1]) if k.startswith("decode") else 0)
    ):
        n, wall, wait, rows, busy, floor = buckets[key]
        print(
            f"{key:18s} {n:6d} {wall:8.2f} {wall / total:6.1%} {1000 * wall / n:8.2f} {1000 * busy / n:11.2f} "
            f"{1000 * wait / n:13.2f} {rows:9d} {floor:8.3f} {floor / wall if wall else 0.0:7.0%}"
        )
    for lo, hi in ((20, 120), (120, 150), (400, 500), (800, 900)):
        w, s = walls[lo:hi], waits[lo:hi]
        if w:
            print(
                f"steps {lo}-{hi}: running ~{sizes[lo]:3d}, wall {1000 * sum(w) / len(w):6.2f} ms/step, "
                f"waiting for the GPU {1000 * sum(s) / len(s):6.2f} ms/step"
            )


def _report_profiles(windows: dict[str, Any], cpu: cProfile.Profile) -> None:
    """The GPU kernels of each profiled window and the host hot spots cProfile caught."""
    for name, prof in windows.items():
        print(f"\nGPU kernels ({name}):")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    out = io.StringIO()
    pstats.Stats(cpu, stream=out).sort_stats("tottime").print_stats(22)
    print("\nhost hot spots over 20 steps (cProfile, tottime):")
    print("\n".join(out.getvalue().splitlines()[:45]))


def _profile_whole_run(sched: Any, submit: Callable[[str], None]) -> None:
    """The workload again from an empty prefix cache, every kernel of it under torch.profiler."""
    sched.reset_prefix_cache()
    submit("w")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        while sched.has_work:
            sched.step()
        torch.cuda.synchronize()
    print("\nGPU kernels over the whole run (a second pass, profiled):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["cpu-gemm", "cpu-step", "gpu"])
    p.add_argument("--rows", default="1,32,64,256,3183", help="cpu-gemm: comma-separated row counts")
    p.add_argument("--model", default="smollm2", help="cpu-step: the model (its decode step is replayed)")
    p.add_argument("--replays", type=int, default=40, help="cpu-step: timed replays")
    p.add_argument("--rebuild", action="store_true", help="cpu-step: rebuild the dense KV copy on every replay")
    p.add_argument(
        "--tokenizer-dir",
        default=str(env.TOKENIZER_DIR.get() or "tok"),
        help="gpu: tokenizer files for the dummy model",
    )
    p.add_argument("--shape", default="qwen3-0.6b", help="gpu: the dummy model's shape (bench throughput's shapes)")
    p.add_argument("--quantization", default=None, help="gpu: e.g. fp8")
    p.add_argument("--disable-overlap", action="store_true", help="gpu")
    p.add_argument("--disable-cuda-graph", action="store_true", help="gpu")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="gpu")
    p.add_argument("--attention-backend", default="auto", help="gpu")
    p.add_argument("--page-size", type=int, default=None, help="default: 16 with FlashInfer on a GPU, else 1")
    p.add_argument("--whole-run", action="store_true", help="gpu: then the whole workload again under torch.profiler")
    p.add_argument("--batch-one", action="store_true", help="gpu: one request, every decode step at batch 1")
    p.add_argument(
        "--tp", type=int, default=1, help="gpu: tensor-parallel ranks (rank 0 is profiled, the rest mirror it)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if args.what == "cpu-gemm":
        gemm([int(r) for r in args.rows.split(",")])
    elif args.what == "cpu-step":
        step(args.model, args.replays, args.rebuild)
    else:
        gpu(args)
