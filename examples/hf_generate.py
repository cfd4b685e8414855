"""HF `model.generate`, unchanged code, running on minisgl: SmolLM2 answers a batch of questions.

Loads SmolLM2 with transformers, patches its generate, answers a left-padded batch, streams one
answer with TextStreamer, then fine-tunes a weight in memory to show that generate follows it.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from minisgl.models.loader import resolve_model
from transformers_minisgl import minisgl_generate, patch_generate


def chat_batch(tokenizer, questions: list[str]) -> dict[str, torch.Tensor]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def main() -> None:
    questions = sys.argv[1:] or [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write a haiku about the sea.",
    ]
    model_dir = resolve_model("smollm2")  # the bundled GGUF, converted once to an HF-style directory
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    patch_generate(model)  # from here on, model.generate runs on minisgl
    inputs = chat_batch(tokenizer, questions)
    out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    for q, a in zip(questions, answers):
        print(f"Q: {q}\nA: {a.strip()}\n")

    print("Streaming (TextStreamer):")
    one = chat_batch(tokenizer, questions[:1])
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    model.generate(**one, max_new_tokens=32, do_sample=False, streamer=streamer)

    # An in-memory edit (here: silencing the token the model wanted first) reaches the engine on the next call.
    first = int(out[0, inputs["input_ids"].shape[1]])
    with torch.no_grad():
        model.lm_head.weight[first] = 0.0
    edited = model.generate(**one, max_new_tokens=16, do_sample=False)
    print(
        f"\nAfter zeroing the weights of {tokenizer.decode([first])!r}:",
        tokenizer.decode(edited[0, one["input_ids"].shape[1] :], skip_special_tokens=True).strip(),
    )

    # The scoped form, on a second model object: transformers' generate is back after the block.
    other = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with minisgl_generate(other):
        other.generate(**one, max_new_tokens=4, do_sample=False)
    print("minisgl_generate block done; other.generate is transformers' again:", "generate" not in vars(other))


if __name__ == "__main__":
    main()
