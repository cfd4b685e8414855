"""A tool-using agent through LangChain on minisgl: the model calls tools, the loop runs them and
feeds the results back as ToolMessages until the model answers in words or a step limit is hit.

    python examples/langchain_agent.py                                  # "What is 12 times 7?" -> multiply -> 84
    python examples/langchain_agent.py --tool add "What is 25 plus 17?"
    python examples/langchain_agent.py "What is 6 times 9?"             # the model picks the tool

ChatMiniSGL finds (or starts) the daemon serving the model. The first step makes the model act: a
grammar-forced call, so even a 135M model produces a well-formed one; --tool NAME forces that tool
(tool_choice=NAME), else any of them (tool_choice="any"). The default SmolLM2-135M writes good arguments
but picks add for "12 times 7", so the default question names multiply; a larger model (--model) picks
for itself. Later steps let the model choose between another call and its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calculator_tools import SYSTEM, TOOLS, parse_args, print_steps
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool


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


def run_agent(
    llm: BaseChatModel, question: str, tools: list[BaseTool] = TOOLS, max_steps: int = 4, first_tool: str | None = None
) -> AgentRun:
    """first_tool: the tool the first step must call (None: any of them)."""
    by_name = {t.name: t for t in tools}
    act = llm.bind_tools(tools, tool_choice=first_tool or "any")
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

    ask = parse_args("A LangChain tool-calling agent on minisgl.")
    llm = ChatMiniSGL(model=ask.model, temperature=0, max_tokens=64)
    run = run_agent(llm, ask.question, first_tool=ask.first_tool)
    print(f"Q: {ask.question}")
    print_steps(run.messages)
    print(f"A: {run.answer.strip()}" if run.answer is not None else "A: (no answer within the step limit)")
    llm.close()


if __name__ == "__main__":
    main()
