"""Python's garbage collector in the throughput workload: LLM.generate against a bare scheduler loop.

Issue 8's workload (256 requests, 133,966 output tokens, Qwen3-0.6B-shaped dummy model, bf16) in one engine, timed
four ways: `LLM.generate` as `minisgl bench throughput` runs it; the scheduler stepped directly (its outputs dropped
at once); `generate` with the collector off; and `generate` after `gc.freeze()` (the startup objects moved out of the
collector's reach, as vLLM does after start-up). Each line gives the seconds, tok/s, the collector's total time,
collections per generation and every pause over 10 ms. Session 12 found generate 0.6-0.9 s slower than the bare loop,
0.64 s of it two full collections over the ~466k startup objects plus the outputs generate kept (docs/benchmarks.md).

    python3 tools/device/gc_probe.py    # after `source tools/device/env.sh`, with .carry/tok carried
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from minisgl import LLM, SamplingParams
from minisgl.bench.throughput import GcTimer, timed_workload, workload, write_model_dir


def _gc_line(t: GcTimer) -> str:
    return f"gc {t.seconds:.3f} s, collections by generation {t.collections}, pauses > 10 ms {t.pauses_ms}"


def main() -> None:
    llm = LLM(str(write_model_dir(Path(".carry/tok"))), dtype="bfloat16", load_format="dummy", max_prefill_tokens=16384)
    sched = llm.scheduler
    prompts, max_tokens = workload()
    print("objects the collector tracks after start-up:", len(gc.get_objects()), flush=True)

    def generate(tag: str) -> None:
        with GcTimer() as t:
            res = timed_workload(llm, sched, (prompts, max_tokens))
        print(f"generate ({tag}): {res['seconds']} s, {res['output_tok_s']} tok/s; {_gc_line(t)}", flush=True)
        sched.reset_prefix_cache()

    def bare(tag: str) -> None:
        torch.cuda.synchronize()
        with GcTimer() as t:
            t0 = time.perf_counter()
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):
                sched.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True))
            n = 0
            while sched.has_work:
                n += sum(len(o.new_token_ids) for o in sched.step())
            s = time.perf_counter() - t0
        print(f"scheduler loop ({tag}): {s:.3f} s, {n / s:.0f} tok/s; {_gc_line(t)}", flush=True)
        sched.reset_prefix_cache()

    generate("collector on")
    bare("a")
    gc.disable()
    generate("collector off")
    gc.enable()
    gc.collect()
    gc.freeze()
    print("frozen:", gc.get_freeze_count(), flush=True)
    generate("after gc.freeze()")
    bare("b")


if __name__ == "__main__":
    main()
