"""Time to first token of fresh prompts with and without the one-request prefill graphs (engine/piecewise.py),
each side in its own process, alternating on one GPU.

    python3 tools/device/ttft_ab.py [--pairs 2] [--prompts 20] [--prompt-len 128] [--shape qwen3-0.6b]

Each process builds the dummy model of `--shape` (bf16, CUDA graphs and overlap on), generates 5 warm-up prompts,
then times `LLM.generate` of `--prompts` fresh prompts (random ids, nothing cached), one at a time with
`max_tokens=1`, and prints their median and spread. "pieces": WHOLE_GRAPH_MAX_TOKENS set to 0, so every prefill runs
as piecewise graphs with eager attention between them; "whole": the default.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from minisgl import LLM, SamplingParams, env
    from minisgl.bench.throughput import write_model_dir
    from minisgl.engine import piecewise

    if args.side == "pieces":
        piecewise.WHOLE_GRAPH_MAX_TOKENS = 0
    model_dir = write_model_dir(Path(env.TOKENIZER_DIR.get() or "tok"), args.shape)
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy")
    rng = random.Random(f"{args.side}-{args.seed}")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(5 + args.prompts):
        prompt = [rng.randint(0, 10000) for _ in range(args.prompt_len)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1000)
    graphs = llm.scheduler.engine.prefill_graphs
    return {
        "ttft_ms_median": round(statistics.median(times), 3),
        "min": round(min(times), 3),
        "max": round(max(times), 3),
        "whole_sizes": sorted(graphs.whole) if graphs is not None else [],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--side", choices=["whole", "pieces"], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side is not None:  # one measuring process
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    common = ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--shape", args.shape]
    for pair in range(args.pairs):
        for side in ("pieces", "whole"):
            cmd = [sys.executable, __file__, "--side", side, "--seed", str(pair), *common]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            print(
                f"pair {pair} {side:6s} TTFT median {result['ttft_ms_median']} ms ({result['min']}-{result['max']}),"
                f" whole graphs {result['whole_sizes']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
