"""LangChain embeddings backed by the local minisgl daemon (Client.embed: last-token pooling, L2-normalised)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from langchain_core.embeddings import Embeddings
from langchain_core.utils import from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from minisgl import DEFAULT_TIMEOUT_S, AsyncClient, Client


class MiniSGLEmbeddings(BaseModel, Embeddings):
    """Embeddings of a model served by minisgl: each text's final hidden state at its last token, after the
    model's last norm, L2-normalised (as vLLM pools decoder models). The daemon is found or started as for
    ChatMiniSGL, and its prefix cache serves texts that share a beginning.

    >>> emb = MiniSGLEmbeddings(model="smollm2")
    >>> vectors = emb.embed_documents(["first text", "second text"])
    >>> query = emb.embed_query("a question")
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = "smollm2"
    """A model name/path as `minisgl serve --model` takes it."""
    address: str | None = Field(default_factory=from_env("MINISGL_ADDRESS", default=None))
    """The daemon serving `model`; None: the one registered for it, started when none runs."""
    auto_start: bool = True
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = DEFAULT_TIMEOUT_S

    _client: Client | None = PrivateAttr(default=None)
    _async_clients: dict[Any, AsyncClient] = PrivateAttr(default_factory=dict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def _sync(self) -> Client:
        with self._lock:
            if self._client is None:
                self._client = Client(self.model, self.address, self.auto_start, self.timeout, **self.engine_kwargs)
            return self._client

    def _async(self) -> AsyncClient:
        loop = asyncio.get_running_loop()  # an AsyncClient belongs to the loop it connected in
        with self._lock:
            for stale in [other for other in self._async_clients if other.is_closed()]:
                del self._async_clients[stale]
            client = self._async_clients.get(loop)
            if client is None:
                client = AsyncClient(self.model, self.address, self.auto_start, self.timeout, **self.engine_kwargs)
                self._async_clients[loop] = client
            return client

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return [e.embedding for e in self._sync().embed(list(texts))]

    def embed_query(self, text: str) -> list[float]:
        return self._sync().embed(text)[0].embedding

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return [e.embedding for e in await self._async().embed(list(texts))]

    async def aembed_query(self, text: str) -> list[float]:
        return (await self._async().embed(text))[0].embedding

    def close(self) -> None:
        """Close the sync client (async ones: `await aclose()` in their loop)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        client = self._async_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()
        self.close()
