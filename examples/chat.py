"""What `bash scripts/run.sh` runs: the bundled SmolLM2 answers a few questions, streamed from its daemon.

    python examples/chat.py ["your question" ...]

The Client finds the daemon already serving smollm2 or starts one (it stops after 5 idle minutes;
MINISGL_IDLE_TIMEOUT sets that), so a re-run answers at once: this process never imports torch or loads the model.
examples/offline_chat.py runs the same questions in this process instead (minisgl.LLM), batched.
"""

from __future__ import annotations

import sys

from minisgl import Client, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


def main() -> None:
    questions = sys.argv[1:] or QUESTIONS
    params = SamplingParams(temperature=0, max_tokens=64)
    with Client("smollm2") as client:
        for q in questions:
            print(f"Q: {q}\nA: ", end="", flush=True)
            text = ""
            for chunk in client.stream([{"role": "user", "content": q}], params):
                piece = chunk.text if text else chunk.text.lstrip()
                text += piece
                print(piece, end="", flush=True)
            print("\n", flush=True)


if __name__ == "__main__":
    main()
