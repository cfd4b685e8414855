"""Cache-aware vs round-robin routing across two minisgl daemons behind a LiteLLM Router.

    minisgl bench routing                          # starts two SmolLM2 daemons, runs both policies
    minisgl bench routing --addresses tcp://127.0.0.1:30001 tcp://127.0.0.1:30002
    minisgl bench routing --policies round-robin,cache-aware,shuffle,single --json out.json

Workload (shared-prefix agents): --agent-types distinct system prompts (a role plus its tool
docs, ~--system-words words each); --agents agents take them in turn, each with its own task, and
run --turns turns concurrently: each turn sends the whole conversation, gets --max-tokens tokens
back (greedy, ignore_eos) and appends a tool result of ~--result-words words. Before each turn an
agent "runs its tool" for a random 0..--think-ms ms, so requests arrive in a random order, as they
do from real agents. Text is drawn from a fixed word list with a fixed seed; every policy runs a
fresh copy of the workload (a per-run salt at the start of each system prompt), so no policy
finds another's prefixes in the caches.

The daemons it starts get a KV pool of --num-pages tokens each (default 16384, more than the
whole workload, ~7,000 prompt tokens over 18 requests), so the defaults measure prefix affinity
alone. The gap between the policies depends on the workload: it narrows as --turns grows
(round-robin finds an older turn of a conversation on either daemon) and when many agents share
a system prompt (--agent-types below --agents: round-robin finds it on both daemons), and it
widens when a daemon's pool cannot hold every conversation (a smaller --num-pages: round-robin
makes both daemons cache everything, halving the cache it can use).

Policies, all through the same LiteLLM Router (routing_strategy simple-shuffle) and provider:
  round-robin  litellm_minisgl.routing.RoundRobinRouting: deployments in turn
  cache-aware  litellm_minisgl.routing.CacheAwareRouting: longest cached prefix, ties by load
  shuffle      LiteLLM's default simple-shuffle alone (random)
  single       every request to the first daemon (the one-replica reference)

Prints, per policy: requests, prompt tokens, cached prompt tokens (usage.prompt_tokens_details),
hit ratio = cached / prompt, end-to-end seconds and requests per daemon; then the ratio of
cache-aware's hit ratio to round-robin's (issue 10's target: >= 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import litellm

import litellm_minisgl
from litellm_minisgl.routing import CacheAwareRouting, RoundRobinRouting
from minisgl.lifetime import parent_env
from minisgl.runtime.launcher import stop_daemon, wait_ready

WORDS = (
    "account address agent answer archive batch budget buffer cache call check city client cluster code column "
    "config context count customer data database date debug deploy device document domain driver email engine "
    "error event export field file filter flight format function graph group handler header history host hotel "
    "index input invoice issue item job key label layer limit list log lookup market memory message metric model "
    "module network node note number object order output owner package page parameter partner path payment plan "
    "policy price product profile project query queue quota record region report request resource result route "
    "rule schedule schema search secret server service session shipment signal source stage status step stock "
    "storage stream summary table target task team template tenant ticket time token tool topic trace user value "
    "vendor version warehouse weather window worker zone"
).split()
ROLES = (
    "travel planner",
    "support triage bot",
    "data analyst",
    "DevOps on-call assistant",
    "sales assistant",
    "logistics coordinator",
    "finance auditor",
    "research librarian",
)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(rng: random.Random, salt: str, kind: int, n_words: int) -> str:
    role = ROLES[kind % len(ROLES)]
    tools = "\n".join(f"- tool_{kind}_{t}(query): {words(rng, n_words // 8)}" for t in range(4))
    return (
        f"[{salt}] You are agent type {kind}, a {role}. Answer tersely and call tools when needed.\n"
        f"Tools:\n{tools}\nGuidelines: {words(rng, n_words // 2)}"
    )


def make_agents(args: argparse.Namespace, salt: str) -> list[list[dict[str, str]]]:
    rng = random.Random(args.seed)
    systems = [system_prompt(rng, salt, k, args.system_words) for k in range(args.agent_types)]
    return [
        [
            {"role": "system", "content": systems[a % args.agent_types]},
            {"role": "user", "content": f"Task {a}: {words(rng, 30)}"},
        ]
        for a in range(args.agents)
    ]


async def run_policy(policy: str, addresses: list[str], args: argparse.Namespace) -> dict[str, Any]:
    litellm_minisgl.register()
    deployments = addresses[:1] if policy == "single" else addresses
    model_list = [
        {
            "model_name": "bench",
            "litellm_params": {"model": f"minisgl/{args.model}", "api_base": a},
            "model_info": {"id": f"daemon-{i}"},
        }
        for i, a in enumerate(deployments)
    ]
    router = litellm.Router(model_list=model_list, routing_strategy="simple-shuffle", num_retries=0)
    callbacks = {"round-robin": [RoundRobinRouting()], "cache-aware": [CacheAwareRouting()]}.get(policy, [])
    previous = litellm.callbacks
    litellm.callbacks = [*previous, *callbacks]
    try:
        return await _run_agents(policy, router, args)
    finally:  # LiteLLM keeps callbacks in module globals: leave them as they were
        litellm.callbacks = previous
        for name in ("success_callback", "failure_callback", "_async_success_callback", "_async_failure_callback"):
            registered = getattr(litellm, name, None)
            if isinstance(registered, list):
                registered[:] = [c for c in registered if not any(c is cb for cb in callbacks)]


async def _run_agents(policy: str, router: Any, args: argparse.Namespace) -> dict[str, Any]:
    conversations = make_agents(args, salt=f"{policy}-{uuid.uuid4().hex[:8]}")
    totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    per_daemon: dict[str, int] = {}

    async def agent(a: int) -> None:
        rng = random.Random(args.seed * 1000 + a)
        messages = conversations[a]
        for turn in range(args.turns):
            await asyncio.sleep(rng.uniform(0, args.think_ms / 1000))
            r = await router.acompletion(
                model="bench",
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            totals["requests"] += 1
            totals["prompt_tokens"] += r.usage.prompt_tokens
            totals["cached_tokens"] += r.usage.prompt_tokens_details.cached_tokens
            daemon = r._hidden_params.get("model_id") or "?"
            per_daemon[daemon] = per_daemon.get(daemon, 0) + 1
            messages = messages + [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"Tool result {turn}: {words(rng, args.result_words)}"},
            ]

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(a) for a in range(args.agents)))
    seconds = time.perf_counter() - t0
    return {
        "policy": policy,
        **totals,
        "hit_ratio": round(totals["cached_tokens"] / max(1, totals["prompt_tokens"]), 4),
        "seconds": round(seconds, 2),
        "per_daemon": dict(sorted(per_daemon.items())),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemons(args: argparse.Namespace, runtime_dir: Path) -> tuple[list[str], list[subprocess.Popen]]:

    os.environ["MINISGL_RUNTIME_DIR"] = str(runtime_dir)
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    flags = ["--num-pages", str(args.num_pages)] if args.num_pages else []
    procs = []
    for i, address in enumerate(addresses):
        log = open(runtime_dir / f"daemon{i}.log", "ab")
        cmd = [
            sys.executable,
            "-m",
            "minisgl",
            "serve",
            "--model",
            args.model,
            "--address",
            address,
            "--no-http",
            *flags,
        ]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=parent_env()))
    for i, (address, proc) in enumerate(zip(addresses, procs)):
        wait_ready(address, 600, proc=proc, log_path=runtime_dir / f"daemon{i}.log")
    return addresses, procs


def stop_daemons(addresses: list[str], procs: list[subprocess.Popen]) -> None:

    for address, proc in zip(addresses, procs):
        try:
            stop_daemon(address, timeout=30)
        except Exception:  # noqa: BLE001 - a daemon that will not stop is killed
            proc.kill()
        proc.wait(30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--addresses", nargs=2, default=None, help="two running daemons (default: start two)")
    p.add_argument("--num-pages", type=int, default=16384, help="KV pool (tokens) of each started daemon")
    p.add_argument("--policies", default="round-robin,cache-aware")
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--agent-types", type=int, default=6, help="distinct system prompts")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=160)
    p.add_argument("--result-words", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--think-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: LiteLLM's bundled cost map
    on_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the daemons it started are stopped too
    procs: list[subprocess.Popen] = []
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="msgl-bench-") as tmp:
        if args.addresses:
            addresses = list(args.addresses)
        else:
            print(f"starting two {args.model} daemons ...", flush=True)
            addresses, procs = start_daemons(args, Path(tmp))
        try:
            for policy in args.policies.split(","):
                result = asyncio.run(run_policy(policy.strip(), addresses, args))
                results.append(result)
                print(
                    f"{result['policy']:<12} requests {result['requests']:>4}  prompt {result['prompt_tokens']:>7}  "
                    f"cached {result['cached_tokens']:>7}  hit ratio {result['hit_ratio']:.3f}  "
                    f"{result['seconds']:>7.1f}s  per daemon {result['per_daemon']}",
                    flush=True,
                )
        finally:
            if procs:
                stop_daemons(addresses, procs)
            signal.signal(signal.SIGTERM, on_sigterm)
    by_policy = {r["policy"]: r for r in results}
    summary: dict[str, Any] = {
        "workload": {k: v for k, v in vars(args).items() if k not in ("json", "addresses", "func", "kind")},
        "results": results,
    }
    if "cache-aware" in by_policy and "round-robin" in by_policy:
        ratio = by_policy["cache-aware"]["hit_ratio"] / max(1e-9, by_policy["round-robin"]["hit_ratio"])
        summary["cache_aware_over_round_robin"] = round(ratio, 3)
        print(f"cache-aware / round-robin hit ratio: {ratio:.2f}x (target >= 1.5x)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary
