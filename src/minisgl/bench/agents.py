"""Shared-prefix agent workload: K agents, one shared system prompt with tool docs, T turns each.

Turn t of an agent sends its whole conversation so far plus a new tool result and generates a
reply; the next turn starts when that reply is done (agents are concurrent, turns are not).
The theoretical maximum of cacheable prompt tokens: for each request, the longest prefix it
shares with any earlier request (the system prompt, then the agent's previous context).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minisgl.bench import write_json
from minisgl.config import EngineConfig
from minisgl.core import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--agents", "-k", type=int, default=32)
    p.add_argument("--turns", "-t", type=int, default=6)
    p.add_argument("--system-len", type=int, default=2000, help="shared system prompt + tool docs (tokens)")
    p.add_argument("--tool-len", type=int, default=200, help="tool result appended each turn (tokens)")
    p.add_argument("--output-len", type=int, default=100, help="tokens generated each turn")
    p.add_argument("--caches", default="radix,naive", help="which caches to run, comma-separated")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=None, help="default: 16 with FlashInfer on a GPU, else 1")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--schedule-policy", default="lpm")
    p.add_argument("--attention-backend", default="auto", help='e.g. "fa3,flashinfer": FA3 prefill on Hopper')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


@dataclass
class Workload:
    system: list[int]
    tool_results: list[list[list[int]]]  # [agent][turn] -> tokens
    turns: int
    output_len: int

    @classmethod
    def make(
        cls, vocab: int, agents: int, turns: int, system_len: int, tool_len: int, output_len: int, seed: int
    ) -> "Workload":
        rng = random.Random(seed)
        tok = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
        return cls(tok(system_len), [[tok(tool_len) for _ in range(turns)] for _ in range(agents)], turns, output_len)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_cacheable: int = 0
    ttft: list[float] = field(default_factory=list)
    ttft_turn: list[int] = field(default_factory=list)  # the turn of each ttft entry
    seconds: float = 0.0
    output_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        ttft = np.array(self.ttft) * 1000 if self.ttft else np.zeros(1)
        computed = self.prompt_tokens - self.cached_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_computed": computed,
            "cached_tokens": self.cached_tokens,
            "max_cacheable_tokens": self.max_cacheable,
            "hit_ratio": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
            "hit_ratio_of_max": round(self.cached_tokens / max(1, self.max_cacheable), 4),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
            "ttft_p50_ms_by_turn": [
                round(float(np.percentile([t for t, k in zip(self.ttft, self.ttft_turn) if k == turn], 50)) * 1000, 1)
                for turn in sorted(set(self.ttft_turn))
            ],
            "seconds": round(self.seconds, 2),
            "output_tokens": self.output_tokens,
        }


def run_workload(sched: Any, work: Workload) -> Stats:
    """Drive the agents through an in-process scheduler (same Scheduler the daemon runs)."""
    params = SamplingParams(temperature=0, max_tokens=work.output_len, ignore_eos=True)
    agents = len(work.tool_results)
    context = [list(work.system) for _ in range(agents)]
    turn = [0] * agents
    sent_at: dict[str, float] = {}
    first_seen: set[str] = set()
    # For the theoretical maximum, computed after the run (O(requests^2 x length), seconds on the host): every
    # sequence so far as a log of (rid, sequence) snapshots; a request records only how long the log was at its
    # submission, so submitting costs O(1) and the bookkeeping does not delay the engine it measures.
    log: list[tuple[str, list[int]]] = []
    submitted: list[tuple[list[int], int]] = []
    stats = Stats()

    def submit(a: int) -> None:
        prompt = context[a] + work.tool_results[a][turn[a]]
        rid = f"agent{a}-turn{turn[a]}"
        stats.prompt_tokens += len(prompt)
        submitted.append((prompt, len(log)))
        log.append((rid, prompt))
        context[a] = prompt
        sent_at[rid] = time.perf_counter()
        sched.add_request(rid, prompt, params)

    t0 = time.perf_counter()
    for a in range(agents):
        submit(a)
    pending = agents
    outputs: dict[str, list[int]] = {}
    while pending:
        for out in sched.step():
            rid = out.rid
            if rid not in first_seen and out.new_token_ids:
                first_seen.add(rid)
                stats.ttft.append(time.perf_counter() - sent_at[rid])
                stats.ttft_turn.append(int(rid.rsplit("-turn", 1)[1]))
            outputs.setdefault(rid, []).extend(out.new_token_ids)
            if not out.finished:
                continue
            stats.cached_tokens += out.cached_tokens
            stats.output_tokens += out.completion_tokens
            a = int(rid.split("-")[0].removeprefix("agent"))
            context[a] = context[a] + outputs.pop(rid)
            log.append((rid, context[a]))
            turn[a] += 1
            if turn[a] < work.turns:
                submit(a)
            else:
                pending -= 1
    stats.seconds = time.perf_counter() - t0
    for prompt, n in submitted:  # each rid's latest snapshot before the submission is what existed then
        stats.max_cacheable += max_shared_prefix(prompt, list(dict(log[:n]).values()))
    return stats


def max_shared_prefix(prompt: list[int], earlier: list[list[int]]) -> int:
    if not earlier:
        return 0
    p = np.asarray(prompt)
    best = 0
    for e in earlier:
        e_arr = np.asarray(e)
        n = min(len(p), len(e_arr))
        diff = np.flatnonzero(p[:n] != e_arr[:n])
        best = max(best, int(diff[0]) if len(diff) else n)
    return min(best, len(prompt) - 1)  # the last prompt token is always computed


def run(args: argparse.Namespace) -> dict[str, Any]:
    from minisgl.runtime.tp import make_scheduler  # lazy: torch, when the benchmark runs
    from minisgl.scheduler import collector  # lazy: torch, when the benchmark runs

    results: dict[str, Any] = {
        "model": args.model,
        "agents": args.agents,
        "turns": args.turns,
        "system_len": args.system_len,
        "tool_len": args.tool_len,
        "output_len": args.output_len,
    }
    for cache in args.caches.split(","):
        config = EngineConfig(
            model=args.model,
            cache=cache,
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            page_size=args.page_size,
            kv_cache_gb=args.kv_cache_gb,
            schedule_policy=args.schedule_policy,
            attention_backend=args.attention_backend,
        )
        sched = make_scheduler(config)
        vocab = sched.model_config.vocab_size
        if sched.tokenizer is not None:
            vocab = min(vocab, len(sched.tokenizer))
        work = Workload.make(vocab, args.agents, args.turns, args.system_len, args.tool_len, args.output_len, args.seed)
        warm = Workload.make(vocab, 1, 1, 16, 4, 2, args.seed + 1)
        run_workload(sched, warm)
        collector.take_over()  # as the daemon's scheduler process does once it is ready
        try:
            stats = run_workload(sched, work)
        finally:
            collector.release()
        sched.check_integrity()
        results[cache] = stats.summary()
        print(f"[{cache}] " + json.dumps(results[cache]))
        if hasattr(sched, "shutdown"):
            sched.shutdown()
        del sched
    if "radix" in results and "naive" in results:
        results["speedup_radix_vs_naive"] = round(results["naive"]["seconds"] / results["radix"]["seconds"], 2)
        results["ttft_p50_ratio_naive_over_radix"] = round(
            results["naive"]["ttft_p50_ms"] / max(1e-9, results["radix"]["ttft_p50_ms"]), 2
        )
        print(
            f"radix vs naive: {results['speedup_radix_vs_naive']}x faster end to end, "
            f"TTFT p50 {results['ttft_p50_ratio_naive_over_radix']}x lower; "
            f"radix hit ratio {results['radix']['hit_ratio_of_max']:.1%} of the theoretical maximum"
        )
    write_json(results, args.json)
    return results
