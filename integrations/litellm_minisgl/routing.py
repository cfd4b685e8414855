"""Cache-aware routing across minisgl daemons behind a LiteLLM Router or proxy.

Each daemon keeps a radix cache of the prompts it served, so a request is cheapest on the
daemon that already holds its longest prefix. CacheAwareRouting remembers, per deployment, the
conversation prefixes it sent there (chained hashes of fixed-size blocks of the canonical
request text: tools, then each message) and narrows LiteLLM's healthy deployments to the one
holding the longest prefix. Ties (a new conversation, a system prompt every daemon holds) go to
the least loaded daemon (requests in flight), then to each daemon in turn; a daemon more than
`balance_threshold` requests busier than the idlest gives way to it.

It plugs into LiteLLM as a callback (CustomLogger.async_filter_deployments, run by the Router's
async path after cooldowns are applied), so LiteLLM's retries, cooldowns and fallbacks stay as
they are. Before answering it pings the chosen daemon (a fraction of a millisecond): one that
does not answer is skipped for `down_s` seconds, so even streams, which LiteLLM cannot retry
once started, avoid a dead daemon.

    router = litellm.Router(model_list=[...two "minisgl/..." deployments of one model_name...])
    litellm.callbacks.append(litellm_minisgl.routing.cache_aware)       # SDK; the proxy: config.yaml

The index is the router's belief, not the daemons' truth: a daemon may have evicted a prefix
(LRU) since. `max_blocks` bounds what is remembered per deployment (least recently used tails
first); about the daemons' KV capacity in tokens times ~4 characters / block_bytes is right.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
from collections import OrderedDict
from typing import Any, Sequence

from litellm.integrations.custom_logger import CustomLogger

from litellm_minisgl.translate import PROVIDER, plain_data
from minisgl import ping

BLOCK_BYTES = 64
MAX_BLOCKS = 1 << 16  # per deployment: ~4 MB of prompt text, ~1M tokens
PING_TIMEOUT_S = 1.0  # a daemon's frontend answers a ping in well under a millisecond
DOWN_S = 5.0  # how long a daemon that did not answer is skipped before it is tried again
BALANCE_THRESHOLD = 16  # requests in flight by which the cache-best daemon may exceed the idlest


def prefix_text(messages: Sequence[Any], tools: Any = None) -> bytes:
    """The canonical bytes of a chat request's prompt, in prompt order: tools, then each message.

    Two requests share a prefix of this text exactly when they share the leading tools and
    messages, which is (up to the chat template) when they share a prefix of prompt tokens.
    """
    parts = [json.dumps(plain_data(tools), sort_keys=True, ensure_ascii=False, default=str) if tools else ""]
    parts += [json.dumps(plain_data(m), sort_keys=True, ensure_ascii=False, default=str) for m in messages]
    return "\x1e".join(parts).encode("utf-8", "replace")


def block_hashes(data: bytes, block_bytes: int = BLOCK_BYTES) -> list[bytes]:
    """Chained hashes of data's blocks: hashes[i] stands for data[: (i + 1) * block_bytes].

    The last, partial block counts too, so a repeated short prompt finds where it went.
    """
    h = hashlib.blake2b(digest_size=16)
    out = []
    for start in range(0, len(data), block_bytes):
        h.update(data[start : start + block_bytes])
        out.append(h.copy().digest())
    return out


class PrefixIndex:
    """Per deployment, the prefix blocks sent to it, least recently used first (bounded).

    A daemon's radix cache evicts the least recently used leaves, so a conversation loses its
    tail first; the index does the same, so what it still holds is always a leading prefix.
    """

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, deployment: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of hashes the deployment holds."""
        blocks = self._blocks.get(deployment)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, deployment: str, hashes: Sequence[bytes]) -> None:
        blocks = self._blocks.setdefault(deployment, OrderedDict())
        for h in reversed(hashes):  # a prefix's first blocks end up most recent: evicted last, like radix leaves
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def size(self, deployment: str) -> int:
        return len(self._blocks.get(deployment) or ())

    def drop(self, deployment: str) -> None:
        """Forget a deployment's blocks (its daemon went away: a new one starts with an empty cache)."""
        self._blocks.pop(deployment, None)


def _deployment_id(deployment: dict[str, Any]) -> str:
    return str((deployment.get("model_info") or {}).get("id"))


def _event_deployment_id(kwargs: dict[str, Any]) -> str | None:
    model_info = (kwargs.get("litellm_params") or {}).get("model_info") or {}
    return str(model_info["id"]) if model_info.get("id") is not None else None


def _is_minisgl(deployment: dict[str, Any]) -> bool:
    return str((deployment.get("litellm_params") or {}).get("model", "")).startswith(PROVIDER + "/")


class _Liveness:
    """Which daemons answered a ping lately; one that did not is skipped for down_s seconds."""

    def __init__(self, ping_timeout_s: float, down_s: float) -> None:
        self.ping_timeout_s = ping_timeout_s
        self.down_s = down_s
        self._down_until: dict[str, float] = {}

    def is_down(self, deployment: str) -> bool:
        return self._down_until.get(deployment, 0.0) > time.monotonic()

    def mark_down(self, deployment: str) -> None:
        self._down_until[deployment] = time.monotonic() + self.down_s

    async def alive(self, deployment: dict[str, Any]) -> bool:
        address = (deployment.get("litellm_params") or {}).get("api_base")
        if not address or not _is_minisgl(deployment):
            return True  # no address to ping (the provider finds or starts the daemon itself)
        try:
            pong = await asyncio.to_thread(ping, address, self.ping_timeout_s)
        except Exception:  # noqa: BLE001 - a refused handshake or a bad address: not a daemon we can use
            pong = None
        if pong is None or pong.state == "stopping":
            self.mark_down(_deployment_id(deployment))
            return False
        return True


class _Load:
    """Requests in flight per deployment, counted from routing to the success/failure event."""

    def __init__(self) -> None:
        self.inflight: dict[str, int] = {}

    def started(self, deployment: str) -> None:
        self.inflight[deployment] = self.inflight.get(deployment, 0) + 1

    def ended(self, deployment: str | None) -> None:
        if deployment is not None and self.inflight.get(deployment, 0) > 0:
            self.inflight[deployment] -= 1

    def of(self, deployment: str) -> int:
        return self.inflight.get(deployment, 0)


class CacheAwareRouting(CustomLogger):
    """LiteLLM callback: send each chat request to the daemon holding its longest prefix.

    providers: the LiteLLM providers whose deployments it routes (others are left to the
    Router's strategy); None routes every model group with more than one deployment.
    """

    def __init__(
        self,
        *,
        block_bytes: int = BLOCK_BYTES,
        max_blocks: int = MAX_BLOCKS,
        balance_threshold: int = BALANCE_THRESHOLD,
        ping_timeout_s: float = PING_TIMEOUT_S,
        down_s: float = DOWN_S,
        providers: Sequence[str] | None = (PROVIDER,),
    ) -> None:
        super().__init__()
        self.block_bytes = block_bytes
        self.balance_threshold = balance_threshold
        self.providers = tuple(providers) if providers is not None else None
        self.index = PrefixIndex(max_blocks)
        self.load = _Load()
        self.liveness = _Liveness(ping_timeout_s, down_s)
        self.routed: dict[str, int] = {}  # requests sent to each deployment
        self.matched_bytes: dict[str, int] = {}  # prefix bytes they were expected to find cached
        self._turn = itertools.count()

    # ------------------------------------------------------------------ the choice

    def rank(self, deployments: list[dict[str, Any]], hashes: Sequence[bytes]) -> list[dict[str, Any]]:
        """Deployments from best to worst for a request whose prefix blocks are hashes."""
        turn = next(self._turn)
        n = len(deployments)
        ids = [_deployment_id(d) for d in deployments]
        matched = [self.index.match(i, hashes) for i in ids]
        loads = [self.load.of(i) for i in ids]
        # Longest prefix, then least loaded, then in turn (new conversations spread evenly).
        order = sorted(range(n), key=lambda k: (-matched[k], loads[k], (k - turn) % n))
        idlest = min(loads)
        if loads[order[0]] - idlest > self.balance_threshold:
            order.sort(key=lambda k: loads[k] - idlest > self.balance_threshold)  # stable: keeps the ranking
        return [deployments[k] for k in order]

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list,
        messages: list | None,
        request_kwargs: dict | None = None,
        parent_otel_span: Any = None,
    ) -> list:
        if len(healthy_deployments) < 2 or messages is None:
            return healthy_deployments
        if self.providers is not None and not all(
            str((d.get("litellm_params") or {}).get("model", "")).split("/", 1)[0] in self.providers
            for d in healthy_deployments
        ):
            return healthy_deployments
        try:
            hashes = block_hashes(prefix_text(messages, (request_kwargs or {}).get("tools")), self.block_bytes)
        except (TypeError, ValueError):
            return healthy_deployments  # a request the provider will reject with a proper error
        candidates = [d for d in healthy_deployments if not self.liveness.is_down(_deployment_id(d))]
        for deployment in self.rank(candidates, hashes):
            chosen = _deployment_id(deployment)
            # Booked before the ping's await, so that requests routed meanwhile see this one.
            matched = self.index.match(chosen, hashes)
            self.index.insert(chosen, hashes)  # its daemon caches the prompt as soon as it is prefilled
            self.load.started(chosen)
            if await self.liveness.alive(deployment):
                self.routed[chosen] = self.routed.get(chosen, 0) + 1
                self.matched_bytes[chosen] = self.matched_bytes.get(chosen, 0) + matched * self.block_bytes
                return [deployment]
            self.load.ended(chosen)
            self.index.drop(chosen)  # a daemon that comes back is a new one, with an empty cache
        return healthy_deployments  # none answers: let the Router and the provider report it

    # ------------------------------------------------------------------ request ends

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self.load.ended(_event_deployment_id(kwargs))

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        deployment = _event_deployment_id(kwargs)
        self.load.ended(deployment)
        status = getattr(kwargs.get("exception"), "status_code", None)
        if deployment is not None and status == 503:  # the daemon is gone or stopping: its cache with it
            self.liveness.mark_down(deployment)
            self.index.drop(deployment)


class RoundRobinRouting(CustomLogger):
    """LiteLLM callback: deployments of a model group in turn (the baseline for cache-aware routing)."""

    def __init__(self) -> None:
        super().__init__()
        self._turns: dict[str, itertools.count] = {}

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list,
        messages: list | None,
        request_kwargs: dict | None = None,
        parent_otel_span: Any = None,
    ) -> list:
        if len(healthy_deployments) < 2:
            return healthy_deployments
        ordered = sorted(healthy_deployments, key=_deployment_id)
        turn = next(self._turns.setdefault(model, itertools.count()))
        return [ordered[turn % len(ordered)]]


# The instance a proxy config names: litellm_settings: {callbacks: [litellm_minisgl.routing.cache_aware]}
cache_aware = CacheAwareRouting()
