"""CPU decode side by side: HF generate, minisgl in fp32 and with each faster weight format.

    minisgl bench cpu [--model smollm2] [--threads 2] [--tokens 64] [--concurrency 32] [--reps 5]

For each: tokens per second of one request (greedy, `--tokens` new tokens) and of `--concurrency` requests
at once (0 skips it), the median of `--reps` runs with the engines interleaved run by run so that a noisy
machine hurts them alike, and its ratio to minisgl fp32 (the plain path); the load average is printed
with the figures. For each quantization its agreement with fp32: top-1 when teacher-forced (the fp32 engine's
greedy continuations of ten prompts are fed back as prompts and each position's most likely token is compared
with fp32's), and greedy over CHAT_TOKENS tokens of answers to eight chat questions (how many of each answer's
first tokens equal fp32's before they part, and how many answers are equal throughout).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from minisgl import LLM, SamplingParams
from minisgl.bench import write_json

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Water boils at",
    "List three fruits:",
    "In 1969, the first humans",
    "import numpy as np\n",
    "The best way to learn a language is",
    "Photosynthesis is the process",
]
CHAT = [
    "What is the capital of Australia?",
    "Give me three tips for sleeping better.",
    "Explain what a binary search does.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into French and Spanish.",
]
CHAT_TOKENS = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the physical cores)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--concurrency", type=int, default=32, help="requests at once for the batched figure (0: none)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per engine (the median is shown)")
    p.add_argument("--modes", default="fp32,fp16,int8", help="comma-separated: fp32 and/or quantizations")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate")
    p.add_argument("--json", help="also write the figures here")
    p.set_defaults(func=run)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _tok_per_s(generate: Any, prompts: list[str], tokens: int) -> float:
    t0 = time.perf_counter()
    generate(prompts)
    return len(prompts) * tokens / (time.perf_counter() - t0)


def agreement(llm: Any, prompt_ids: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of the reference continuations' tokens that are llm's top-1 when teacher-forced."""
    seqs = [p + r for p, r in zip(prompt_ids, reference)]
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    hits = total = 0
    for p, seq, out in zip(prompt_ids, seqs, outs):
        for i in range(len(p), len(seq)):
            top = max(out.prompt_logprobs[i][1], key=lambda t: t[1])[0]
            hits += top == seq[i]
            total += 1
    return hits / total


def chat_answers(llm: Any) -> list[list[int]]:
    """llm's greedy answers to CHAT, CHAT_TOKENS tokens each."""
    params = SamplingParams(temperature=0, max_tokens=CHAT_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.chat([[{"role": "user", "content": q}] for q in CHAT], params, use_tqdm=False)]


def greedy_agreement(llm: Any, reference: list[list[int]]) -> tuple[float, int]:
    """(mean count of each chat answer's first tokens equal to the reference's before they part, answers equal
    throughout) over llm's answers to CHAT."""
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(answer, ref)) if a != b), len(ref))
        for answer, ref in zip(chat_answers(llm), reference)
    ]
    return sum(prefixes) / len(prefixes), sum(p == CHAT_TOKENS for p in prefixes)


def _hf_generate(model_dir: str, tokens: int) -> Any:
    import torch  # lazy: `minisgl bench --help` loads every benchmark
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers' import takes seconds

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def generate(prompts: list[str]) -> None:
        batch = tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            model.generate(
                **batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )

    return generate


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engines: dict[str, Any] = {}
    for mode in args.modes.split(","):
        llm = LLM(args.model, quantization=None if mode == "fp32" else mode, threads=args.threads, kv_cache_gb=0.25)
        engines[mode] = lambda prompts, llm=llm: llm.generate(prompts, params, use_tqdm=False)
        engines[mode].llm, engines[mode].params = llm, params
    if not args.no_hf:
        model_dir = str(next(iter(engines.values())).llm.scheduler.engine.model_dir)
        engines["hf generate"] = _hf_generate(model_dir, args.tokens)
    batch = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.concurrency)]
    single: dict[str, list[float]] = {name: [] for name in engines}
    batched: dict[str, list[float]] = {name: [] for name in engines}
    for generate in engines.values():
        generate(PROMPTS[:1])  # warm-up: weights packed, caches allocated
    load_before = os.getloadavg()[0]
    for _ in range(args.reps):
        for name, generate in engines.items():
            single[name].append(_tok_per_s(generate, PROMPTS[:1], args.tokens))
            if batch:
                batched[name].append(_tok_per_s(generate, batch, args.tokens))
    load = (load_before, os.getloadavg()[0])
    result: dict[str, Any] = dict(
        cpu=cpu_name(),
        threads=torch.get_num_threads(),
        date=time.strftime("%Y-%m-%d"),
        model=args.model,
        load=load,
        reps=args.reps,
        rows={},
    )
    _print_rows(result, engines, single, batched, args)
    write_json(result, args.json)
    return result


def _print_rows(
    result: dict[str, Any],
    engines: dict[str, Any],
    single: dict[str, list[float]],
    batched: dict[str, list[float]],
    args: argparse.Namespace,
) -> None:
    """Fill result["rows"] (medians, ratios to fp32, agreement) and print them as a table."""
    fp32 = engines.get("fp32")
    if fp32 is not None:
        params = fp32.params
        prompt_ids = [fp32.llm.tokenizer.encode(p) for p in PROMPTS]
        reference = [o.token_ids for o in fp32.llm.generate(PROMPTS, params, use_tqdm=False)]
        chat_ref = chat_answers(fp32.llm)
    base = statistics.median(single["fp32"]) if fp32 is not None else None
    load = result["load"]
    print(f"{result['cpu']}, {result['threads']} threads, {args.model}, {args.tokens} new tokens per request")
    print(f"median of {args.reps} interleaved runs; load average {load[0]:.2f} before, {load[1]:.2f} after")
    print(
        f"{'engine':<14}{'1 request tok/s':>17}{'vs fp32':>9}"
        f"{f'{args.concurrency} requests tok/s' if args.concurrency else 'batched (skipped)':>22}{'top-1 vs fp32':>15}"
        f"{'chat greedy: same first tokens':>32}"
    )
    for name in engines:
        agree = greedy = None
        if fp32 is not None and hasattr(engines[name], "llm") and name != "fp32":
            agree = agreement(engines[name].llm, prompt_ids, reference)
            greedy = greedy_agreement(engines[name].llm, chat_ref)
        one = statistics.median(single[name])
        many = statistics.median(batched[name]) if batched[name] else None
        ratio = one / base if base else None
        row = dict(single=one, single_runs=single[name], batched=many, vs_fp32=ratio, agreement=agree)
        if greedy is not None:
            row.update(chat_same_prefix=greedy[0], chat_same_answers=greedy[1])
        result["rows"][name] = row
        shown = [
            f"{one:>17.1f}",
            f"{ratio:>8.2f}x" if ratio is not None else f"{'':>9}",
            f"{many:>22.1f}" if many is not None else f"{'-':>22}",
            f"{agree:>15.1%}" if agree is not None else "",
            f"{greedy[0]:>11.1f}/{CHAT_TOKENS} ({greedy[1]}/{len(CHAT)} equal)" if greedy is not None else "",
        ]
        print(f"{name:<14}" + "".join(shown))
