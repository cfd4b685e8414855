"""The calculator agent of langchain_agent.py (its tools in calculator_tools.py) on LangChain's own agent loop,
`langchain.agents.create_agent` (pip install langchain; the [all] extra has it):

    python examples/langchain_create_agent.py                 # "What is 12 times 7?" -> multiply -> 84
    python examples/langchain_create_agent.py --tool add "What is 25 plus 17?"

A small model left to choose (tool_choice "auto") answers from memory instead of calling a tool, so a middleware
forces the first model call: the named tool (tool_choice=NAME), else any tool ("any"); after the tool's result the
model answers in words.
"""

from __future__ import annotations

from typing import Any, Callable

from calculator_tools import SYSTEM, TOOLS, parse_args, print_steps
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, wrap_model_call
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

    ask = parse_args("A LangChain create_agent agent on minisgl.")
    llm = ChatMiniSGL(model=ask.model, temperature=0, max_tokens=64)
    agent = create_agent(llm, TOOLS, system_prompt=SYSTEM, middleware=[force_first_call(ask.first_tool)])
    state = agent.invoke({"messages": [{"role": "user", "content": ask.question}]}, {"recursion_limit": 8})
    print(f"Q: {ask.question}")
    print_steps(state["messages"])
    final = state["messages"][-1]
    print(f"A: {final.text.strip()}" if isinstance(final, AIMessage) and not final.tool_calls else "A: (no answer)")
    llm.close()


if __name__ == "__main__":
    main()
