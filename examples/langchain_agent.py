"""A tool-using agent through LangChain on minisgl: the model calls tools, the loop runs them and
feeds the results back as ToolMessages until the model answers in words or a step limit is hit.

    python examples/langchain_agent.py "What is 12 times 7?"

ChatMiniSGL finds (or starts) the daemon serving the model. The first step makes the model act
(tool_choice="any": a grammar-forced call of one of the tools, so even a 135M model produces a
well-formed call); later steps let it choose between another call and its answer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
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


@dataclass
class AgentRun:
    answer: str | None  # the model's final words; None when the step limit came first
    messages: list[BaseMessage] = field(default_factory=list)  # the whole conversation, tool turns included


def run_tool(tools: dict[str, BaseTool], call: dict) -> ToolMessage:
    """The ToolMessage answering one tool call; a failure becomes an error result the model can read."""
    chosen = tools.get(call["name"])
    if chosen is None:
        return ToolMessage(f"Error: no tool named {call['name']!r}", tool_call_id=call["id"], status="error")
    try:
        return chosen.invoke(call)
    except Exception as e:  # noqa: BLE001 - bad arguments are reported back to the model
        return ToolMessage(f"Error: {e}", tool_call_id=call["id"], name=call["name"], status="error")


def run_agent(llm: BaseChatModel, question: str, tools: list[BaseTool] = TOOLS, max_steps: int = 4) -> AgentRun:
    by_name = {t.name: t for t in tools}
    act = llm.bind_tools(tools, tool_choice="any")
    decide = llm.bind_tools(tools)
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    for step in range(max_steps):
        reply = (act if step == 0 else decide).invoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if not reply.tool_calls:
            return AgentRun(reply.text, messages)
        messages.extend(run_tool(by_name, call) for call in reply.tool_calls)
    return AgentRun(None, messages)


def main() -> None:
    from langchain_minisgl import ChatMiniSGL

    question = " ".join(sys.argv[1:]) or "What is 12 times 7?"
    llm = ChatMiniSGL(model="smollm2", temperature=0, max_tokens=64)
    run = run_agent(llm, question)
    for m in run.messages[1:]:
        if isinstance(m, AIMessage) and m.tool_calls:
            for call in m.tool_calls:
                print(f"-> {call['name']}({call['args']})")
        elif isinstance(m, ToolMessage):
            print(f"<- {m.content}")
        elif isinstance(m, HumanMessage):
            print(f"Q: {m.text}")
    print(f"A: {run.answer}" if run.answer is not None else "A: (no answer within the step limit)")
    llm.close()


if __name__ == "__main__":
    main()
