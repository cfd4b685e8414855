"""The process-wide plugin manager: the "minisgl" entry-point group's plugins, added to the registries.

The registries (minisgl.models.registry, minisgl.attention.registry) hold the built-ins and import nothing
of the plugins; this loader sits above them and adds what the plugins' registration hooks return. The engine
starts it before it looks a model or backend up, and the scheduler asks it for the lifecycle hooks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pluggy

from minisgl import hooks
from minisgl.attention import registry as attention_registry
from minisgl.models import registry as model_registry


@functools.lru_cache(maxsize=None)
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    pm.load_setuptools_entrypoints(hooks.PROJECT)
    # pluggy calls the last registered first; register in reverse so later registrations win.
    for models in reversed(pm.hook.minisgl_register_architectures()):
        for name, model in (models or {}).items():
            model_registry.register_architecture(name, model)
    for backends in reversed(pm.hook.minisgl_register_attention_backends()):
        for name, factory in (backends or {}).items():
            attention_registry.register_backend(name, factory)
    return pm


def architectures() -> dict[str, type]:
    """Every registered architecture's model class, the plugins' included."""
    get_plugin_manager()
    return {name: model_registry.get_model_class(name) for name in model_registry.registered_architectures()}


def attention_backends() -> dict[str, Callable[..., Any]]:
    """Every registered attention backend's factory, the plugins' included."""
    get_plugin_manager()
    return attention_registry.registered_backends()


def has_impl(hook_name: str) -> bool:
    """True when some plugin implements a lifecycle hook (so callers can skip it otherwise)."""
    return bool(getattr(get_plugin_manager().hook, hook_name).get_hookimpls())
