"""The reasoning parser (minisgl.structured.reasoning) against a whole-text reference written here.

Every split of each output into stream deltas must give what the reference gives for the whole text.
"""

from __future__ import annotations

import itertools
import random
import re

import pytest

from minisgl.structured.reasoning import ReasoningParser, opens_in_reasoning


def reference(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None, answer): the block opens with a leading <think> (or in the prompt) and ends at the
    first </think>; whitespace around the reasoning and before the answer goes; an unclosed block is all reasoning."""
    if not in_reasoning:
        opened = re.match(r"\s*<think>", text)
        if opened is None:
            return None, text
        text = text[opened.end() :]
    reasoning, closed, answer = text.partition("</think>")
    return reasoning.strip(), answer.lstrip() if closed else ""


OUTPUTS = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False),
    ("\n<think>a</think>b", False),
    ("Hello!", False),
    ("  Hello, no thinking here.", False),
    ("<think></think>\n\nDirect answer.", False),
    ("<think>\nunfinished: max_tokens came first  ", False),
    ("<thin", False),
    ("<think>x < y and y </thinking> is not a tag</think> ok", False),
    ("<think>a</think>b <think>c</think>", False),
    ("Thinking since the prompt opened it.\n</think>\n\nAnswer.", True),
    ("All reasoning, never closed \n", True),
    ("\n\n</think>Answer right away", True),
    ("", False),
    ("", True),
]


def _stream(parts: list[str], in_reasoning: bool) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    reasoning, answer = "", ""
    for part in parts:
        r, a = parser.feed(part)
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("text,in_reasoning", OUTPUTS)
def test_every_split_of_the_stream_gives_the_whole_texts_answer(text: str, in_reasoning: bool) -> None:
    want = reference(text, in_reasoning)
    assert ReasoningParser.parse(text, in_reasoning) == want
    flat = (want[0] or "", want[1])
    for i, j in itertools.combinations(range(len(text) + 1), 2):  # every split into three deltas
        assert _stream([text[:i], text[i:j], text[j:]], in_reasoning) == flat, (text[:i], text[i:j], text[j:])
    assert _stream(list(text), in_reasoning) == flat  # one character at a time


def test_random_outputs_agree_with_the_reference() -> None:
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b c", "<thi", "nk>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 10)))
        in_reasoning = rng.random() < 0.3
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(0, 5))))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        want = reference(text, in_reasoning)
        assert _stream(parts, in_reasoning) == (want[0] or "", want[1]), (text, parts)


def test_the_prompt_tells_whether_the_output_starts_inside_the_block() -> None:
    assert opens_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking=False
    assert not opens_in_reasoning("<|im_start|>assistant\n")
