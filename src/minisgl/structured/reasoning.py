"""Reasoning parsers: split a thinking model's output into its reasoning and its answer, whole or streaming.

Qwen3, QwQ and DeepSeek-R1 write their reasoning between <think> and </think>, then the answer.
Their chat templates may open the block in the prompt (DeepSeek-R1, Qwen3-Thinking-2507: the output
starts inside it), close an empty one there (Qwen3 with enable_thinking=False: no reasoning), or
leave it to the model (Qwen3: the output starts with <think>). `opens_in_reasoning(prompt_text)`
tells the first case from the prompt; in the others the output's own first tag decides.

One parser follows one sample: feed(text delta) -> (reasoning delta, content delta), then finish().
Whitespace right after <think> and </think>, and right before </think>, is dropped (as the models
write "<think>\n...\n</think>\n\n"); a reasoning block that never closes (max_tokens reached) is
all reasoning. Streamed deltas concatenate to parse(text) for every split of the text.
"""

from __future__ import annotations

from minisgl.structured.parsers import partial_suffix

START, END = "<think>", "</think>"  # the tags of every parser in minisgl.config.REASONING_PARSERS


def opens_in_reasoning(prompt_tail: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block (the output starts as reasoning)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(START)


class ReasoningParser:
    """States: "start" (the output may open with <think>), "reasoning", "content"."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""  # text not yet given out: a possible tag, or whitespace whose fate is not known yet
        self.reasoning_started = False  # leading whitespace of the reasoning is dropped
        self.content_started = False  # and of the content after </think>
        self.closed = False  # </think> seen

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self.state = stripped[len(START) :], "reasoning"
                elif not stripped or START.startswith(stripped):
                    break  # whitespace, or the tag arriving: wait
                else:
                    self.state = "content"
                    self.content_started = True  # no reasoning: the content is the text as written
            elif self.state == "reasoning":
                if not self.reasoning_started:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.reasoning_started = True
                end = self.buf.find(END)
                if end >= 0:
                    reasoning.append(self.buf[:end].rstrip())
                    self.buf, self.state, self.closed = self.buf[end + len(END) :], "content", True
                    continue
                # Hold back a tag that may be arriving and trailing whitespace (dropped if </think> follows).
                keep = partial_suffix(self.buf, END)
                head, tail = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                body = head.rstrip()
                reasoning.append(body)
                self.buf = head[len(body) :] + tail
                break
            else:
                if not self.content_started:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.content_started = True
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is left at the end: an unclosed block's tail is reasoning; held text before any tag is content."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest.rstrip(), ""
        if self.state == "start":
            return "", rest  # no tag came: the text as written
        return "", rest if self.content_started else ""

    @classmethod
    def parse(cls, text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
        """(reasoning or None when there was none, content) of a whole output."""
        parser = cls(in_reasoning)
        r1, c1 = parser.feed(text)
        had_reasoning = parser.state == "reasoning" or parser.closed
        r2, c2 = parser.finish()
        return (r1 + r2 if had_reasoning else None), c1 + c2
