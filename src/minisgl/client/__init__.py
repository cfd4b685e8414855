"""Client and AsyncClient: talk to the local minisgl daemon over ZeroMQ (finding or starting it).

    from minisgl import Client, AsyncClient, SamplingParams

    c = Client(model="smollm2")                      # finds the daemon serving smollm2, starts one if none
    out = c.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    out.text, out.token_ids, out.finish_reason, out.usage       # usage: prompt/completion/cached tokens
    for chunk in c.stream([{"role": "user", "content": "Hi"}]):  # chat messages, text, or token ids
        print(chunk.text, end="")                                 # deltas; usage on the last chunk

    async with AsyncClient(model="smollm2") as ac:
        out = await ac.generate("Hello")
        async for chunk in ac.stream("Hello"):
            ...

Every request is independent (the daemon batches concurrent ones). Leaving a stream early
(break, close(), an exception, a cancelled task) or a timeout aborts the request in the daemon,
which frees its KV pages. Errors arrive as the typed minisgl.errors exceptions
(InvalidRequestError, PromptTooLongError, GrammarError, ...); DaemonNotRunningError and
DaemonTimeoutError say what to do about the daemon itself.
"""

from __future__ import annotations

from minisgl.client.aio import AsyncClient, AsyncStream
from minisgl.client.core import DEFAULT_TIMEOUT_S, Prompt
from minisgl.client.results import Embedding, GenerateResult, merge_tool_calls
from minisgl.client.sync import Client, Stream
from minisgl.core import CompletionOutput
from minisgl.runtime.auth import ClientCurve
from minisgl.runtime.launcher import PING_TIMEOUT_S
from minisgl.runtime.launcher import ping as _ping
from minisgl.runtime.protocol import Chunk, Pong, Usage

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "CompletionOutput",
    "DEFAULT_TIMEOUT_S",
    "Embedding",
    "GenerateResult",
    "PING_TIMEOUT_S",
    "Prompt",
    "Stream",
    "Usage",
    "merge_tool_calls",
    "ping",
]


def ping(address: str, timeout: float = PING_TIMEOUT_S) -> Pong | None:
    """The Pong (state: "loading", "ready" or "stopping"; model; ...) of the daemon at address, or None
    when nothing answers. CURVE keys are found as a Client finds them; a refused handshake raises DaemonError."""
    return _ping(address, timeout, ClientCurve.resolve(None, None))
