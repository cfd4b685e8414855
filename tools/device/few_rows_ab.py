"""Decode time per step at a few requests (batch 1-8) with the GEMV of 2-4 rows (layers/gemv.py) and without it
(`MINISGL_GEMV_ROWS=1`: cuBLAS from two rows up), each side in its own process, alternating on one GPU.

    python3 tools/device/few_rows_ab.py [--pairs 3] [--batches 1,2,3,4,8] [--shape qwen3-0.6b] [--rows 1,4]

`--rows` lists the MINISGL_GEMV_ROWS of the sides (1: cuBLAS from two rows up; 2: the GEMV up to two rows);
`--baseline REV` adds a side that runs git revision REV's src/ (with the last of `--rows`), first in each round.

Each process builds the dummy model of `--shape` (bf16, CUDA graphs and overlap on) and, for each batch size b,
generates b fresh 128-token prompts (random ids, nothing cached) with 1 and with 257 new tokens, greedy, three
times each; the time per decode step is the difference of the best of each over 256 steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(args: argparse.Namespace) -> dict[str, float]:
    from minisgl import LLM, SamplingParams, env
    from minisgl.bench.throughput import write_model_dir

    model_dir = write_model_dir(Path(env.TOKENIZER_DIR.get() or "tok"), args.shape)
    timings = _TuneLog()  # what layers/gemv.py's tune measured for each shape and bucket of rows
    logging.getLogger("minisgl").addHandler(timings)
    logging.getLogger("minisgl").setLevel(logging.INFO)
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy")
    rng = random.Random(f"{args.side}-{args.seed}")

    def best_of_3(batch: int, new_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        best = float("inf")
        for _ in range(3):
            prompts = [[rng.randint(0, 10000) for _ in range(128)] for _ in range(batch)]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        return best

    best_of_3(8, 16)  # warm-up
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, object] = {str(b): round((best_of_3(b, 257) - best_of_3(b, 1)) / 256 * 1000, 3) for b in batches}
    gemms = [m for m in llm.scheduler.engine.model.modules() if getattr(getattr(m, "gemm", None), "gemv", None)]
    result["gemv rows"] = sorted(
        {f"{'x'.join(map(str, m.weight.shape))}: {sorted(m.gemm.gemv)} norm {sorted(m.gemm.norm_gemv)}" for m in gemms}
    )
    result["tune"] = timings.lines
    return result


class _TuneLog(logging.Handler):
    """Keeps the lines that tune logs (one per weight shape and bucket of rows: cuBLAS against the GEMV)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "minisgl" and "-row " in (message := record.getMessage()):
            self.lines.append(message)


def baseline_src(rev: str, into: Path) -> Path:
    """src/ of git revision rev exported under into (git archive), for a side that runs the earlier code."""
    root = Path(__file__).resolve().parents[2]
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def run_side(side: str, rows: str, src: Path | None, seed: int, common: list[str]) -> dict:
    """One measuring process: MINISGL_GEMV_ROWS=rows, and src (an earlier revision's) first on PYTHONPATH if given."""
    env = {**os.environ, "MINISGL_GEMV_ROWS": rows}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--side", side, "--seed", str(seed), *common]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--batches", default="1,2,3,4,8")
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--rows", default="1,4", help="MINISGL_GEMV_ROWS of each side, in the order they run")
    p.add_argument("--baseline", help="a git revision: one more side, first in each round, runs its code")
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side is not None:  # one measuring process
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    common = ["--batches", args.batches, "--shape", args.shape]
    rows_list = args.rows.split(",")
    sides = [("cublas" if rows == "1" else f"rows{rows}", rows, None) for rows in rows_list]
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            sides.insert(0, (args.baseline, rows_list[-1], baseline_src(args.baseline, Path(tmp))))
        runs: dict[str, dict[str, list[float]]] = {}
        for pair in range(args.pairs):
            for side, rows, src in sides:
                result = run_side(side, rows, src, pair, common)
                chosen, tuned = result.pop("gemv rows"), result.pop("tune")
                if pair == 0:
                    print("\n".join(f"  {side} tune: {line}" for line in tuned), flush=True)
                for b, ms in result.items():
                    runs.setdefault(side, {}).setdefault(b, []).append(ms)
                steps = ", ".join(f"batch {b}: {ms} ms" for b, ms in result.items())
                print(f"pair {pair} {side:6s} decode step {steps}; GEMV row buckets {chosen}", flush=True)
    for side, by_batch in runs.items():
        cells = (f"batch {b}: {statistics.median(v):.3f} ms ({min(v):.3f}-{max(v):.3f})" for b, v in by_batch.items())
        print(f"median of {args.pairs} {side:6s} " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
