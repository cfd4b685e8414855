"""HF model.generate, unpatched vs patched with transformers_minisgl, on the same model object.

Two prompt sets, both greedy and one left-padded batch, as a transformers user would call it:
- random (default): the offline workload shape of `minisgl bench offline`: random token prompts with
  lengths spread over [input_len / 2, input_len], output_len new tokens each (EOS masked with
  min_new_tokens, so both sides generate exactly the same number of tokens);
- offline: issue 8's offline workload prompts (random.seed(0); `randint(100, 1024)` ids of
  `randint(0, 10000)` each), output_len new tokens each (EOS masked): one generate call has one
  max_new_tokens, so the workload's per-request output lengths do not apply;
- chat: 32 different questions through the model's chat template, up to output_len new tokens and
  stopping at EOS, so the answers end at different lengths (what transformers' static batch keeps
  computing, as padding, until the longest answer ends).

    minisgl bench hf-generate                                    # 32 random prompts, SmolLM2, CPU fp32
    minisgl bench hf-generate --prompt-set chat --output-len 256 # 32 chat questions, CPU fp32
    minisgl bench hf-generate --repeat 3                         # alternate 3 timed runs each, keep the best
    minisgl bench hf-generate --num-prompts 256 --device cuda    # GPU, bf16
    minisgl bench hf-generate --num-prompts 256 --device cuda --prompt-set offline --output-len 256
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl import SamplingParams
from minisgl.bench import write_json
from minisgl.bench.offline import make_prompts
from minisgl.models.loader import resolve_model
from transformers_minisgl import patch_generate

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about the ocean.",
    "What is 17 times 23?",
    "Give me three tips for better sleep.",
    "Who wrote Romeo and Juliet?",
    "Describe how a rainbow forms.",
    "What is the boiling point of water in Kelvin?",
    "Translate 'good morning' into Spanish.",
    "List the planets of the solar system.",
    "Why is the sky blue?",
    "Write a short story about a robot learning to paint.",
    "What is a prime number?",
    "How do vaccines work?",
    "Name a famous painting by Leonardo da Vinci.",
    "What are the benefits of regular exercise?",
    "Explain what a neural network is.",
    "What is the largest mammal on Earth?",
    "Suggest a name for a pet goldfish.",
    "How many continents are there?",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Cinderella.",
    "How does a bicycle stay upright?",
    "What is gravity?",
    "Give me a recipe for pancakes.",
    "What does DNA stand for?",
    "Why do leaves change color in autumn?",
    "Explain the water cycle.",
    "What is the speed of light?",
    "How do bees make honey?",
]


def chat_prompts(tokenizer: object, n: int) -> list[list[int]]:
    msgs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    return [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in msgs
    ]


def answer_tokens(new: torch.Tensor, eos: int | list[int] | None) -> int:
    """Generated tokens up to and including each row's first EOS (what follows is padding)."""
    eos_ids = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    total = 0
    for row in new.cpu():
        hits = torch.isin(row, eos_ids).nonzero()
        total += int(hits[0, 0]) + 1 if len(hits) else len(row)
    return total


def engine_alone(model: object, prompts: list[list[int]], output_len: int, on_cuda: bool) -> None:
    """The patched model's own engine through LLM.generate on the same prompts: the floor for the patched call."""

    llm = model._minisgl_generate.llm  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()  # the patched call cached these prompts
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    print(f"engine alone (LLM.generate, ignore_eos): {len(prompts) * output_len / elapsed:.1f} tok/s in {elapsed:.2f}s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model dir, .gguf, alias or hub id")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-set", choices=["random", "offline", "chat"], default="random")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also: cProfile the patched call, and time the engine alone (LLM.generate) on the same work",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed runs per side, alternating transformers and minisgl; the best of each is reported "
        "(a shared machine's noise only ever slows a run down)",
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.set_defaults(func=run)


def _bench_prompts(args: argparse.Namespace, model_dir: Any, vocab_size: int) -> list[list[int]]:
    """The token prompts of --prompt-set: chat questions, the offline bench's random lengths, or fixed-length ones."""

    if args.prompt_set == "chat":
        return chat_prompts(AutoTokenizer.from_pretrained(str(model_dir)), args.num_prompts)
    if args.prompt_set == "offline":
        random.seed(0)
        return [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(args.num_prompts)]
    return make_prompts(vocab_size, args.num_prompts, args.input_len, args.seed)


def _profiled(timed_run: Callable[[], tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, float]:
    """timed_run under cProfile; prints the 25 costliest functions by own time."""

    prof = cProfile.Profile()
    prof.enable()
    result = timed_run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:

    on_cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if on_cuda else torch.float32)
    model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    prompts = _bench_prompts(args, model_dir, model.config.vocab_size)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(q)) + q for q in prompts], device=args.device)
    attention_mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts], device=args.device)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=args.output_len, pad_token_id=pad)
    if args.prompt_set != "chat":
        kwargs["min_new_tokens"] = args.output_len
    warmup = dict(attention_mask=attention_mask[:2, -8:], max_new_tokens=4, pad_token_id=pad)

    def timed(label: str, generate: object) -> tuple[torch.Tensor, float]:
        generate(input_ids[:2, -8:], **warmup)  # type: ignore[operator]
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(input_ids, **kwargs)  # type: ignore[operator]
        if on_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        new_tokens = answer_tokens(out[:, width:], model.generation_config.eos_token_id)
        print(
            f"{label:>12}: {new_tokens} answer tokens ({out.shape[0]} x {out.shape[1] - width} generated) "
            f"in {elapsed:.2f}s = {new_tokens / elapsed:.1f} tok/s",
            flush=True,
        )
        return out, elapsed

    hf_generate = model.generate
    patch_generate(model)
    state = model._minisgl_generate  # type: ignore[attr-defined]
    hf_times: list[float] = []
    ms_times: list[float] = []
    for _ in range(args.repeat):
        hf_out, elapsed = timed("transformers", hf_generate)
        hf_times.append(elapsed)
        state.llm.reset_prefix_cache()  # every timed run starts cold, like the first
        if args.profile:
            ms_out, elapsed = _profiled(lambda: timed("minisgl", model.generate))
            engine_alone(model, prompts, args.output_len, on_cuda)
        else:
            ms_out, elapsed = timed("minisgl", model.generate)
        ms_times.append(elapsed)
    hf_s, ms_s = min(hf_times), min(ms_times)
    same_rows = int((hf_out == ms_out).all(dim=1).sum()) if hf_out.shape == ms_out.shape else 0
    new_tokens = answer_tokens(hf_out[:, width:], model.generation_config.eos_token_id)
    result = {
        "model": str(args.model),
        "prompt_set": args.prompt_set,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "answer_tokens": new_tokens,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "hf_seconds": round(hf_s, 3),
        "hf_output_tok_s": round(new_tokens / hf_s, 1),
        "minisgl_seconds": round(ms_s, 3),
        "minisgl_output_tok_s": round(new_tokens / ms_s, 1),
        "speedup": round(hf_s / ms_s, 2),
        "repeat": args.repeat,
        "hf_runs_s": [round(t, 2) for t in hf_times],
        "minisgl_runs_s": [round(t, 2) for t in ms_times],
        "same_outputs": same_rows == len(prompts),
        "identical_rows": f"{same_rows}/{len(prompts)}",
    }
    print(f"speedup {result['speedup']}x; identical rows {result['identical_rows']}")
    write_json(result, args.json)
    print(json.dumps(result))
    return result
