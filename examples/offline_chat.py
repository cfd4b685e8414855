"""The main job on the CPU default: the bundled SmolLM2 answers a few questions, batched."""

from __future__ import annotations

import sys

from minisgl import LLM, SamplingParams


def main() -> None:
    questions = sys.argv[1:] or [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write a haiku about the sea.",
    ]
    llm = LLM("smollm2")
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], SamplingParams(temperature=0, max_tokens=64))
    for q, out in zip(questions, outs):
        print(
            f"Q: {q}\nA: {out.text.strip()}\n   ({out.prompt_tokens} prompt tokens, {out.completion_tokens} generated, "
            f"{out.cached_tokens} from the prefix cache, finish: {out.finish_reason})\n"
        )


if __name__ == "__main__":
    main()
