"""A mixture-of-experts model on the CPU: a tiny random Qwen3-MoE checkpoint (8 experts, top-2) made here with
transformers, served by minisgl, and its greedy tokens checked against HF transformers' own generate.

    python examples/tiny_moe.py [--family qwen3_moe|mixtral] [--out DIR]

The same code path serves a real checkpoint: LLM("/path/to/Qwen3-30B-A3B") (a GPU for that size).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from minisgl import LLM, SamplingParams
from minisgl.models.loader import resolve_model


def make_checkpoint(family: str, out: Path) -> Path:
    """Random weights in HF's format (one tensor per expert and projection), SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3MoeConfig

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    shape = dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if family == "mixtral":
        config = MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, **shape)
    else:
        config = Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, **shape
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # wider than HF's init, so that the router's choices and the tokens are clear
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    parser.add_argument("--out", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    model_dir = make_checkpoint(args.family, args.out or Path(tempfile.mkdtemp(prefix=f"tiny-{args.family}-")))
    llm = LLM(str(model_dir))
    config = llm.model_config
    print(f"{config.architecture}: {config.num_experts} experts, top-{config.num_experts_per_tok}")
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              min_new_tokens=16, pad_token_id=0)[0, ids.shape[1]:].tolist()  # fmt: skip
        print(f"{prompt!r} -> {out.text!r}  (same tokens as HF transformers: {out.token_ids == ref})")


if __name__ == "__main__":
    main()
