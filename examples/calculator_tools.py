"""The calculator agent's tools, system prompt and command line, shared by the LangChain examples:
langchain_agent.py (its own tool loop) and langchain_create_agent.py (LangChain's create_agent)."""

from __future__ import annotations

import argparse
from typing import NamedTuple, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import BaseTool, tool


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS: list[BaseTool] = [multiply, add]
SYSTEM = "You are a calculator assistant. Use the tools for arithmetic, then state the result."


class Ask(NamedTuple):
    question: str
    first_tool: str | None  # the tool the first step must call (None: any of them)
    model: str


def parse_args(description: str) -> Ask:
    """The question, the forced first tool and the model from the command line. Without a question the default one
    names multiply: SmolLM2-135M writes good arguments but picks add for "12 times 7"."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("question", nargs="*", help='default: "What is 12 times 7?" (with --tool multiply)')
    parser.add_argument("--tool", choices=[t.name for t in TOOLS], help="the tool the first step must call")
    parser.add_argument("--model", default="smollm2", help="the model (default: smollm2)")
    args = parser.parse_args()
    question = " ".join(args.question) or "What is 12 times 7?"
    return Ask(question, args.tool or (None if args.question else "multiply"), args.model)


def print_steps(messages: Sequence[BaseMessage]) -> None:
    """Each tool call (-> name(args)) and each tool result (<- result) of a conversation, in order."""
    for m in messages:
        if isinstance(m, AIMessage) and m.tool_calls:
            for call in m.tool_calls:
                print(f"-> {call['name']}({call['args']})")
        elif isinstance(m, ToolMessage):
            print(f"<- {m.content}")
