"""N-gram speculative decoding on and off, on three agent-like workloads, at batch 1 and 16.

    minisgl bench spec [--model smollm2] [--threads 2] [--tokens 160] [--batches 1,16] [--reps 3]
                       [--record-pattern pattern.json]

Workloads: copy-with-edit (rewrite a code block with a rename), a tool call whose JSON arguments repeat values of a
tool result, and free prose. For each: greedy decode tokens per second with speculation off and on (the median of
`--reps` runs, engines interleaved run by run so a noisy machine hurts both alike, with the spread), the mean
accepted length (tokens a verified row emits per step: accepted drafts + 1) and whether the outputs are identical.
A batch is that many variants of the workload (the names differ). The prompts are cached by a warm-up run, so a
timed run is decode (and the verify steps) only; the drafts from earlier runs' outputs are forgotten before each run,
so every run drafts from its own text alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from minisgl.bench import write_json
from minisgl.scheduler.ngram import SharedNgrams

CODE = '''def compute_total(items, tax_rate):
    """The price of every item with its quantity, plus tax."""
    total = 0.0
    for item in items:
        if item.quantity <= 0:
            continue
        price = item.price * item.quantity
        if item.discount:
            price = price * (1 - item.discount)
        total += price
    return round(total * (1 + tax_rate), 2)


def print_receipt(items, tax_rate):
    for item in items:
        print(f"{item.name}: {item.quantity} x {item.price}")
    print("Total:", compute_total(items, tax_rate))
'''
NAMES = ["sum_prices", "order_total", "basket_value", "checkout_sum", "cart_total", "bill_amount", "grand_total",
         "price_sum", "invoice_total", "total_cost", "final_price", "amount_due", "full_price", "net_total",
         "items_total", "cost_sum"]  # fmt: skip
RECORD = (
    '{"id": "ord-{i}7731", "customer": {"name": "Maria Lopez", "email": "maria.lopez@example.com"}, '
    '"shipping": {"street": "221 Baker Street", "city": "Springfield", "zip": "49007"}, "items": '
    '[{"sku": "KB-204", "qty": 2}, {"sku": "MS-110", "qty": 1}], "status": "paid"}'
)
TOPICS = ["a lighthouse keeper", "a city garden", "the first snow", "an old violin", "a night train",
          "a lost key", "a desert storm", "a small bakery", "a mountain lake", "a forgotten letter",
          "a robot painter", "a summer market", "a quiet library", "a river crossing", "a winter fox",
          "a paper boat"]  # fmt: skip


def workloads(batch: int) -> dict[str, list[list[dict[str, str]]]]:
    """Each workload's `batch` conversations (variants that differ in a name)."""
    copy = [
        [
            {
                "role": "user",
                "content": f"Rewrite this code, renaming `compute_total` to `{NAMES[i % 16]}`. "
                f"Give the whole code.\n\n```python\n{CODE}```",
            }
        ]  # fmt: skip
        for i in range(batch)
    ]
    tool = [
        [
            {"role": "user", "content": f"Look up order ord-{i}7731."},
            {"role": "assistant", "content": f'get_order({{"id": "ord-{i}7731"}})'},
            {"role": "user", "content": "Tool result: " + RECORD.replace("{i}", str(i))},
            {
                "role": "user",
                "content": "Now call create_shipment with a JSON object holding the order id, the "
                "customer's name and email, the full shipping address and the items. Answer with the JSON only.",
            },
        ]  # fmt: skip
        for i in range(batch)
    ]
    prose = [[{"role": "user", "content": f"Write a short story about {TOPICS[i % 16]}."}] for i in range(batch)]
    return {"copy-with-edit": copy, "tool-call": tool, "prose": prose}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the physical cores)")
    p.add_argument("--tokens", type=int, default=160, help="new tokens per request at most (greedy)")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--workloads", default="copy-with-edit,tool-call,prose")
    p.add_argument("--reps", type=int, default=3, help="timed runs per engine and case (the median is shown)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--record-pattern",
        help="write each workload's acceptance at batch 1 here (prompt and output lengths, each verify step's "
        "position, drafted and accepted tokens), for `minisgl bench spec-replay` on a GPU",
    )
    p.set_defaults(func=run)


def record_pattern(llm: Any, convs: list[Any], params: Any) -> dict[str, Any]:
    """One run of a batch-1 workload with speculation: its lengths and [output position, drafted, accepted] of every
    verify step (bench/spec_replay.py replays them)."""
    spec = llm.scheduler.spec
    spec.shared = SharedNgrams()  # as in a timed run: drafts from this run's text only
    steps: list[list[int]] = []
    settle = spec.settle

    def recording(req: Any, drafted: int, accepted: int) -> None:
        if drafted:
            steps.append([len(req.output_ids), drafted, accepted])
        settle(req, drafted, accepted)

    spec.settle = recording
    try:
        out = llm.chat(convs[0], params, use_tqdm=False)
    finally:
        del spec.settle
    return {"prompt_len": out.prompt_tokens, "output_len": len(out.token_ids), "steps": steps}


def _timed(llm: Any, convs: list[Any], params: Any) -> tuple[float, list[list[int]], dict[str, int]]:
    """One run: (seconds, each output's tokens, the speculation counters' change)."""
    spec = llm.scheduler.spec
    before = dict(spec.stats()) if spec is not None else {}
    if spec is not None:
        spec.shared = SharedNgrams()  # drafts from this run's text only
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = spec.stats() if spec is not None else {}
    delta = {k: after[k] - before.get(k, 0) for k in after}
    outs = outs if isinstance(outs, list) else [outs]
    return seconds, [o.token_ids for o in outs], delta


def _case(engines: dict[str, Any], convs: list[Any], params: Any, reps: int) -> dict[str, Any]:
    for llm in engines.values():
        llm.chat(convs, params, use_tqdm=False)  # warm-up: the prompts are cached from now on
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    counters: dict[str, int] = {}
    for _ in range(reps):
        for name, llm in engines.items():
            seconds, tokens[name], delta = _timed(llm, convs, params)
            rates[name].append(sum(map(len, tokens[name])) / seconds)
            for k, v in delta.items():
                counters[k] = counters.get(k, 0) + v
    rows = counters.get("spec_verify_rows", 0)
    result: dict[str, Any] = {
        name: {"tok_s": statistics.median(r), "min": min(r), "max": max(r)} for name, r in rates.items()
    }
    result["accept_len"] = 1 + counters.get("spec_accepted_tokens", 0) / rows if rows else 1.0
    result["speedup"] = result["on"]["tok_s"] / result["off"]["tok_s"]
    result["identical"] = tokens["on"] == tokens["off"]
    result["tokens"] = sum(map(len, tokens["off"]))
    return result


def run(args: argparse.Namespace) -> None:
    from minisgl import LLM, SamplingParams
    from minisgl.engine.threads import default_threads

    threads = args.threads or default_threads()
    engines = {mode: LLM(args.model, threads=threads, speculative=spec, kv_cache_gb=0.5) for mode, spec in
               (("off", None), ("on", "ngram"))}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    cpu = platform.processor() or platform.machine()
    print(f"# {args.model}, {threads} threads, {cpu}, load {os.getloadavg()[0]:.1f}")
    print(f"{'workload':<16}{'batch':>6}{'off tok/s':>12}{'on tok/s':>12}{'speedup':>9}{'accept':>8}  identical")
    results: dict[str, Any] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        cases = workloads(batch)
        for name in args.workloads.split(","):
            r = _case(engines, cases[name], params, args.reps)
            results[f"{name}/{batch}"] = r
            spread = f"({r['off']['min']:.1f}-{r['off']['max']:.1f} | {r['on']['min']:.1f}-{r['on']['max']:.1f})"
            print(
                f"{name:<16}{batch:>6}{r['off']['tok_s']:>12.1f}{r['on']['tok_s']:>12.1f}{r['speedup']:>8.2f}x"
                f"{r['accept_len']:>8.2f}  {r['identical']}  {spread}",
                flush=True,
            )
    write_json({"model": args.model, "threads": threads, "results": results}, args.json)
    if args.record_pattern:
        cases = workloads(1)
        recorded = {name: record_pattern(engines["on"], cases[name], params) for name in args.workloads.split(",")}
        write_json({"model": args.model, "workloads": recorded}, args.record_pattern)
