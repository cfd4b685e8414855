"""Tensor parallelism on a 2-GPU machine: parity, throughput, two "nodes"; plus the HF drop-in and agents figures.

    minisgl bench tp all --out-dir out            # every stage, a table at the end (tools/device/gpu_tp_check.sh)
    minisgl bench tp gen --model-dir D --tp 2 --out F [--teacher-force G] [--nnodes 2 --dist-init-addr A]
    minisgl bench tp bench --model-dir D --tp 2 [--num-requests 256] [--latency]

Stages of `all` (each engine in its own process, so each sizes its KV pool from a clean GPU):
  parity   a Qwen3-shaped checkpoint with HF's random init (8 layers, hidden 1024, 16 q / 8 kv heads,
           vocab 49152, tied), bf16. TP=2 greedy outputs are scored by the TP=1 engine teacher-forced
           (its greedy top-1 after every prefix of TP=2's output) and by HF fp32, everywhere and where
           fp32 HF's top-2 margin is clear (> 1% of the top logit), as tests/test_gpu.py does.
  nodes    the same TP=2 run as two "nodes" on one machine: node 1 is `minisgl serve --node-rank 1`
           with CUDA_VISIBLE_DEVICES=1, node 0 an LLM(nnodes=2, node_rank=0) with CUDA_VISIBLE_DEVICES=0,
           tcp rendezvous on 127.0.0.1; its outputs must equal the single-node TP=2 outputs.
  tput     the offline workload (`minisgl bench throughput`'s workload()) on a Qwen3-14B-shaped dummy
           model (40 layers, hidden 5120, 40 q / 8 kv heads, intermediate 17408, vocab 151936, untied; --shape
           qwen3-30b-a3b: the mixture-of-experts one), bf16, TP=1 (one GPU) vs TP=2.
  hfpatch  `minisgl bench hf-generate` --num-prompts 256 --device cuda on a Qwen3-0.6B-shaped HF checkpoint.
  kill     a `minisgl serve --tp 2` daemon (Qwen3-0.6B shape, dummy weights) has rank 1 SIGKILLed in the middle of a
           stream: the stream must end with a typed error, the daemon exit non-zero and nothing of its process
           session outlive it, all within bounded time (kill_rank_check; tests/test_tp.py runs it on CPU).
  agents   `minisgl bench agents` -k 64 -t 6 on the Qwen3-0.6B-shaped dummy model, radix and naive each in
           its own process (the first engine's KV pool is not given back inside one process).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from minisgl import LLM, SamplingParams
from minisgl.bench.throughput import decode_latency, timed_workload, workload
from minisgl.bench.tp_stages import cmd_all
from minisgl.bench.tp_support import PARITY_ENGINE, agreement, kill_rank_check, parity_prompts, profile_steps
from minisgl.env import TOKENIZER_DIR

__all__ = ["add_arguments", "agreement", "kill_rank_check", "parity_prompts", "run"]


def cmd_gen(args: argparse.Namespace) -> None:
    kw: dict[str, Any] = dict(PARITY_ENGINE, dtype=args.dtype, device=args.device, tp=args.tp, dist_timeout=90)
    if args.device == "cpu":
        kw.pop("cuda_graph_max_bs")
    if args.nnodes > 1:
        kw.update(nnodes=args.nnodes, node_rank=0, dist_init_addr=args.dist_init_addr)
    prompts = parity_prompts(args.num_prompts)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"tp": args.tp, "nnodes": args.nnodes}
    with LLM(str(args.model_dir), **kw) as llm:
        result["init_s"] = round(time.perf_counter() - t0, 1)
        result["tokens"] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if args.teacher_force:
            # This engine's greedy top-1 after every prefix of the other run's outputs (one token each).
            other = json.loads(Path(args.teacher_force).read_text())["tokens"]
            reqs = [p + o[:t] for p, o in zip(prompts, other) for t in range(len(o))]
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            flat = [o.token_ids[0] for o in llm.generate(reqs, one, use_tqdm=False)]
            forced, i = [], 0
            for o in other:
                forced.append(flat[i : i + len(o)])
                i += len(o)
            result["forced_top1"] = forced
        llm.check_integrity()
    Path(args.out).write_text(json.dumps(result))
    print(f"gen tp={args.tp} nnodes={args.nnodes}: {len(result['tokens'])} outputs in {time.perf_counter() - t0:.1f}s")
    sys.stdout.flush()
    os._exit(0)  # the figures are written: no wait on NCCL's exit handlers


# ---------------------------------------------------------------------------- bench: offline throughput


def cmd_bench(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    t0 = time.perf_counter()
    llm = LLM(
        str(args.model_dir),
        dtype="bfloat16",
        load_format="dummy",
        tp=args.tp,
        max_prefill_tokens=16384,
        dist_timeout=180,
    )
    init_s = time.perf_counter() - t0
    sched = getattr(llm.scheduler, "sched", llm.scheduler)
    result: dict[str, Any] = {"tp": args.tp, "requests": args.num_requests}
    result.update(timed_workload(llm, sched, workload(args.num_requests)))
    result.update(init_s=round(init_s, 1), kv_pages=sched.cache.num_pages)
    print("RESULT " + json.dumps(result), flush=True)
    if args.latency:
        print("LATENCY " + json.dumps(decode_latency(llm)), flush=True)
    if args.profile_dir:
        print("PROFILE " + json.dumps(profile_steps(llm, args.profile_dir)), flush=True)
    t0 = time.perf_counter()
    llm.shutdown()
    print(f"shutdown {time.perf_counter() - t0:.1f}s", flush=True)
    os._exit(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=["all", "gen", "bench"])
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--tokenizer-dir", default=str(TOKENIZER_DIR.get() or "tok"))
    p.add_argument("--out-dir", default="tp-out")
    p.add_argument("--out")
    p.add_argument("--stages", default="parity,nodes,tput,kill,hfpatch,agents")
    p.add_argument("--agents-prefill", default="8192", help="agents: max_prefill_tokens values, comma-separated")
    p.add_argument("--hfpatch-args", default="", help="hfpatch: more `minisgl bench hf-generate` arguments")
    p.add_argument("--deadline", type=float, default=540, help="seconds: later stages are skipped past it")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--dist-init-addr")
    p.add_argument("--shape", default="qwen3-14b", help="tput: the dummy model's shape (bench throughput's shapes)")
    p.add_argument("--tp2-env", default="", help='tput and kill: more TP=2 runs, ";"-separated, each "VAR=value ..."')
    p.add_argument("--profile", action="store_true", help="all/tput: profile each run's ranks over one batch after it")
    p.add_argument("--repeat", type=int, default=1, help="tput: run TP=1, TP=2, ... in turn this many times (medians)")
    p.add_argument("--profile-dir", help="bench: profile the ranks over one batch after the run, into this directory")
    p.add_argument("--teacher-force", help="gen: also score these outputs (json) teacher-forced")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--parity-prompts", type=int, default=32)
    p.add_argument("--parity-new", type=int, default=48)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--bench-timeout", type=float, default=200)
    p.add_argument("--latency", action="store_true", help="bench: also ms/token at batch 1")
    p.add_argument("--tiny", action="store_true", help="parity: a tiny model (CPU smoke test of this benchmark)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    {"all": cmd_all, "gen": cmd_gen, "bench": cmd_bench}[args.mode](args)
