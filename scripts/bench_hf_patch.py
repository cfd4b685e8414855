"""HF model.generate, unpatched vs patched with transformers_minisgl, on the same model object.

The offline workload shape of `minisgl bench offline`: random prompts with lengths spread over
[input_len / 2, input_len] (one left-padded batch), output_len new tokens each (EOS masked with
min_new_tokens, so both sides generate the same number of tokens), greedy.

    python scripts/bench_hf_patch.py                                   # 32 prompts, SmolLM2, CPU fp32
    python scripts/bench_hf_patch.py --num-prompts 256 --device cuda   # the GPU figure (bf16)
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model dir, .gguf, alias or hub id")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from minisgl.bench.offline import make_prompts
    from minisgl.models.loader import resolve_model
    from transformers_minisgl import patch_generate

    on_cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if on_cuda else torch.float32)
    model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    prompts = make_prompts(model.config.vocab_size, args.num_prompts, args.input_len, args.seed)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(q)) + q for q in prompts], device=args.device)
    attention_mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts], device=args.device)
    kwargs = dict(
        attention_mask=attention_mask, do_sample=False, max_new_tokens=args.output_len,
        min_new_tokens=args.output_len, pad_token_id=pad,
    )
    warmup = dict(attention_mask=attention_mask[:2, -8:], max_new_tokens=4, pad_token_id=pad)

    def timed(label: str) -> tuple[torch.Tensor, float]:
        model.generate(input_ids[:2, -8:], **warmup)
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        if on_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        new_tokens = (out.shape[1] - width) * out.shape[0]
        print(f"{label:>12}: {new_tokens} new tokens in {elapsed:.2f}s = {new_tokens / elapsed:.1f} tok/s", flush=True)
        return out, elapsed

    hf_out, hf_s = timed("transformers")
    patch_generate(model)
    ms_out, ms_s = timed("minisgl")
    same_rows = int((hf_out == ms_out).all(dim=1).sum()) if hf_out.shape == ms_out.shape else 0
    new_tokens = (hf_out.shape[1] - width) * hf_out.shape[0]
    result = {
        "model": str(args.model), "device": args.device, "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "hf_seconds": round(hf_s, 3), "hf_output_tok_s": round(new_tokens / hf_s, 1),
        "minisgl_seconds": round(ms_s, 3), "minisgl_output_tok_s": round(new_tokens / ms_s, 1),
        "speedup": round(hf_s / ms_s, 2), "same_outputs": same_rows == len(prompts),
        "identical_rows": f"{same_rows}/{len(prompts)}",
    }
    print(f"speedup {result['speedup']}x; identical rows {result['identical_rows']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
