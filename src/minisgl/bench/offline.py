"""Offline throughput: N random prompts of input_len tokens, output_len new tokens each (EOS ignored)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import torch

from minisgl import LLM, SamplingParams
from minisgl.bench import write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="longest prompt; lengths spread over [len/2, len]")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--page-size", type=int, default=None, help="default: 16 with FlashInfer on a GPU, else 1")
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--compare-hf", action="store_true", help="also time HF transformers generate (batched, left-padded)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed runs per engine, alternating (A B A B ...; minisgl from a cold prefix cache each time); the best "
        "is reported",
    )
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=run)


# A side of a comparison: the call to time, and what runs (untimed) before each call.
Side = tuple[Callable[[], Any], Callable[[], Any] | None]


def alternating_runs(sides: dict[str, Side], repeat: int) -> dict[str, tuple[list[float], Any]]:
    """Each side's seconds per call and its last result, the sides taking turns (A B A B ...): a slow spell of a
    shared machine hits every side alike instead of one side's runs."""
    runs: dict[str, list[float]] = {name: [] for name in sides}
    results: dict[str, Any] = {}
    for _ in range(repeat):
        for name, (fn, setup) in sides.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            results[name] = fn()
            runs[name].append(time.perf_counter() - t0)
    return {name: (runs[name], results.get(name)) for name in sides}


def make_prompts(vocab_size: int, num: int, max_len: int, seed: int) -> list[list[int]]:
    """Random prompts with lengths spread over [max_len / 2, max_len] (so HF needs left padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (num,), generator=g).tolist()
    # Skip the low ids where special tokens usually live.
    return [torch.randint(100, vocab_size - 100, (n,), generator=g).tolist() for n in lengths]


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        page_size=args.page_size,
        max_prefill_tokens=args.max_prefill_tokens,
        device=args.device,
        attention_backend=args.attention_backend,
        load_format=args.load_format,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap=args.disable_overlap,
        tp=args.tp,
    )
    vocab = (
        min(llm.model_config.vocab_size, len(llm.tokenizer))
        if llm.tokenizer is not None
        else llm.model_config.vocab_size
    )
    prompts = make_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    # Each run starts without the warm-up's (or a previous run's) cached prefixes.
    sides: dict[str, Side] = {
        "minisgl": (lambda: llm.generate(prompts, params, use_tqdm=False), llm.scheduler.reset_prefix_cache)
    }
    if args.compare_hf:
        sides["hf"] = (hf_generate(llm, prompts, args.output_len), None)
    timings = alternating_runs(sides, args.repeat)
    runs, outs = timings["minisgl"]
    elapsed = min(runs)
    out_tokens = sum(len(o.token_ids) for o in outs)
    result: dict[str, Any] = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "device": str(llm.scheduler.device) if hasattr(llm.scheduler, "device") else args.device,
        "repeat": args.repeat,
        "minisgl_runs_s": [round(t, 2) for t in runs],
        "minisgl_seconds": round(elapsed, 3),
        "minisgl_output_tok_s": round(out_tokens / elapsed, 1),
        "minisgl_total_tok_s": round((out_tokens + sum(map(len, prompts))) / elapsed, 1),
    }
    print(f"minisgl: {out_tokens} output tokens in {elapsed:.2f}s = {out_tokens / elapsed:.1f} tok/s")
    if args.compare_hf:
        hf = hf_figures(*timings["hf"], prompts)
        result.update(hf)
        result["speedup_vs_hf"] = round(result["minisgl_output_tok_s"] / hf["hf_output_tok_s"], 2)
        print(f"HF generate: {hf['hf_output_tok_s']:.1f} tok/s -> minisgl is {result['speedup_vs_hf']}x")
    write_json(result, args.json)
    print(json.dumps(result))
    return result


def hf_generate(llm: Any, prompts: list[list[int]], output_len: int) -> Callable[[], Any]:
    """A call of HF transformers generate on the prompts (one left-padded batch, the engine's dtype and device),
    its model loaded and warmed up."""
    from transformers import AutoModelForCausalLM  # lazy: transformers' import takes seconds

    engine = llm.scheduler.engine
    model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype).to(engine.device).eval()
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=engine.device)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2], max_new_tokens=4, pad_token_id=pad)

    def generate() -> Any:
        with torch.inference_mode():
            return model.generate(input_ids, attention_mask=attention_mask, **kwargs)

    return generate


def hf_figures(runs: list[float], out: Any, prompts: list[list[int]]) -> dict[str, Any]:
    elapsed = min(runs)
    new_tokens = (out.shape[1] - max(map(len, prompts))) * out.shape[0]
    return {
        "hf_runs_s": [round(t, 2) for t in runs],
        "hf_seconds": round(elapsed, 3),
        "hf_output_tok_s": round(new_tokens / elapsed, 1),
    }
