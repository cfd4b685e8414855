"""LiteLLM provider for minisgl, and cache-aware routing across several daemons.

    import litellm, litellm_minisgl
    litellm_minisgl.register()              # adds "minisgl" to litellm.custom_provider_map
    litellm.completion(model="minisgl/smollm2", messages=[...], api_base="ipc:///...")  # api_base: optional

For the LiteLLM proxy, name the handler in config.yaml (see examples/litellm/):

    litellm_settings:
      custom_provider_map:
        - {provider: minisgl, custom_handler: litellm_minisgl.handler}
      callbacks: [litellm_minisgl.routing.cache_aware]   # optional: cache-aware routing across daemons
"""

from __future__ import annotations

import litellm

from litellm_minisgl.provider import MiniSGLLLM
from litellm_minisgl.translate import PROVIDER

__all__ = ["MiniSGLLLM", "PROVIDER", "handler", "register"]

handler = MiniSGLLLM()


def register(custom_handler: MiniSGLLLM | None = None) -> MiniSGLLLM:
    """Make "minisgl/<model>" a LiteLLM model (idempotent); returns the handler in use."""
    custom_handler = custom_handler or handler
    others = [p for p in litellm.custom_provider_map if p.get("provider") != PROVIDER]
    litellm.custom_provider_map = [*others, {"provider": PROVIDER, "custom_handler": custom_handler}]
    litellm.utils.custom_llm_setup()  # so get_llm_provider (and a Router's checks) know the prefix now
    return custom_handler
