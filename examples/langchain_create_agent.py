"""The calculator agent of langchain_agent.py on LangChain's own agent loop, `langchain.agents.create_agent`
(pip install langchain; the [all] extra has it):

    python examples/langchain_create_agent.py                 # "What is 12 times 7?" -> multiply -> 84
    python examples/langchain_create_agent.py --tool add "What is 25 plus 17?"

A small model left to choose (tool_choice "auto") answers from memory instead of calling a tool, so a middleware
forces the first model call: the named tool (tool_choice=NAME), else any tool ("any"); after the tool's result the
model answers in words.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, wrap_model_call
from langchain_agent import SYSTEM, TOOLS
from langchain_core.messages import AIMessage, ToolMessage


def force_first_call(tool: str | None) -> Any:
    """A middleware: the model's first call (no tool result yet) must call `tool` (None: any tool)."""

    @wrap_model_call
    def first_call(request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice=tool or "any")
        return handler(request)

    return first_call


def main() -> None:
    from langchain_minisgl import ChatMiniSGL

    parser = argparse.ArgumentParser(description="A LangChain create_agent agent on minisgl.")
    parser.add_argument("question", nargs="*", help='default: "What is 12 times 7?" (with --tool multiply)')
    parser.add_argument("--tool", choices=[t.name for t in TOOLS], help="the tool the first step must call")
    parser.add_argument("--model", default="smollm2", help="the model (default: smollm2)")
    args = parser.parse_args()
    question = " ".join(args.question) or "What is 12 times 7?"
    tool = args.tool or (None if args.question else "multiply")
    llm = ChatMiniSGL(model=args.model, temperature=0, max_tokens=64)
    agent = create_agent(llm, TOOLS, system_prompt=SYSTEM, middleware=[force_first_call(tool)])
    state = agent.invoke({"messages": [{"role": "user", "content": question}]}, {"recursion_limit": 8})
    print(f"Q: {question}")
    for m in state["messages"]:
        if isinstance(m, AIMessage) and m.tool_calls:
            for call in m.tool_calls:
                print(f"-> {call['name']}({call['args']})")
        elif isinstance(m, ToolMessage):
            print(f"<- {m.content}")
    final = state["messages"][-1]
    print(f"A: {final.text.strip()}" if isinstance(final, AIMessage) and not final.tool_calls else "A: (no answer)")
    llm.close()


if __name__ == "__main__":
    main()
