"""Online serving: Poisson arrivals against a daemon (TTFT, TPOT, throughput), and the daemon-path
overhead against offline LLM.generate on the same requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import numpy as np

from minisgl import LLM
from minisgl.bench import write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--address", default=None, help="a running daemon (default: find or start the one for --model)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="longest prompt; lengths spread over [len/2, len]")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)"
    )
    p.add_argument(
        "--compare-offline", action="store_true", help="also run the same requests with offline LLM.generate"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def make_requests(vocab: int, num: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab - 100) for _ in range(rng.randint(max(1, max_len // 2), max_len))] for _ in range(num)
    ]


async def _one(client: Any, prompt: list[int], params: Any, delay: float) -> dict[str, float]:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    first = None
    tokens = 0
    async for chunk in client.stream(prompt, params):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(chunk.token_ids)
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens, "latency": end - start}


async def _run_online(args: argparse.Namespace, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    from minisgl import AsyncClient  # lazy: zmq, when the benchmark runs

    rng = np.random.default_rng(args.seed)
    gaps = (
        rng.exponential(1.0 / args.request_rate, len(prompts))
        if np.isfinite(args.request_rate)
        else np.zeros(len(prompts))
    )
    delays = np.cumsum(gaps) - gaps[0]
    async with AsyncClient(model=args.model, address=args.address) as client:
        await client.generate(prompts[0][:8], params.__class__(temperature=0, max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, p, params, float(d)) for p, d in zip(prompts, delays)))
        elapsed = time.perf_counter() - t0
    ttft = np.array([r["ttft"] for r in results]) * 1000
    tpot = np.array([r["tpot"] for r in results]) * 1000
    out_tokens = sum(r["tokens"] for r in results)
    return {
        "online_seconds": round(elapsed, 2),
        "online_output_tok_s": round(out_tokens / elapsed, 1),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
        "tpot_p50_ms": round(float(np.percentile(tpot, 50)), 1),
        "tpot_p99_ms": round(float(np.percentile(tpot, 99)), 1),
        "request_throughput": round(len(prompts) / elapsed, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from minisgl import Client, SamplingParams  # lazy: zmq, when the benchmark runs

    with Client(model=args.model, address=args.address) as c:
        info = c.model_info()
        args.address = c.address
    vocab = int(info.get("vocab_size") or 32000)
    prompts = make_requests(vocab, args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, Any] = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
    }
    result.update(asyncio.run(_run_online(args, prompts, params)))
    print("online: " + json.dumps(result))
    if args.compare_offline:
        llm = LLM(args.model)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        result["offline_seconds"] = round(elapsed, 2)
        result["offline_output_tok_s"] = round(sum(len(o.token_ids) for o in outs) / elapsed, 1)
        result["daemon_overhead_pct"] = round(
            100 * (1 - result["online_output_tok_s"] / result["offline_output_tok_s"]), 1
        )
        print(
            f"offline: {result['offline_output_tok_s']} tok/s; daemon path: {result['online_output_tok_s']} tok/s "
            f"({result['daemon_overhead_pct']}% throughput loss)"
        )
    write_json(result, args.json)
    return result
