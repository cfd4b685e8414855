"""The process-wide plugin manager: built-ins first, then the "minisgl" entry-point group.

A registry names implementations, it does not import them: an architecture may be registered as
a "module:attribute" reference (as entry points are), loaded here on first use. The built-ins do
so, which keeps plugins -> builtin_plugin free of any import of the models that use the registry.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import pluggy

from minisgl import hooks


@functools.lru_cache(maxsize=None)
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    from minisgl import builtin_plugin

    pm.register(builtin_plugin, name="minisgl.builtin")
    pm.load_setuptools_entrypoints(hooks.PROJECT)
    return pm


def _merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    # pluggy calls the last registered first; merge so later registrations win.
    merged: dict[str, Any] = {}
    for result in reversed(results):
        merged.update(result or {})
    return merged


def _load(ref: Any) -> Any:
    """A registered object, or the one a "module:attribute" reference names."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def architectures() -> dict[str, type]:
    merged = _merged(get_plugin_manager().hook.minisgl_register_architectures())
    return {name: _load(ref) for name, ref in merged.items()}


@functools.lru_cache(maxsize=None)
def attention_backends() -> dict[str, Callable[..., Any]]:
    return _merged(get_plugin_manager().hook.minisgl_register_attention_backends())


def has_impl(hook_name: str) -> bool:
    """True when some plugin implements a lifecycle hook (so callers can skip it otherwise)."""
    return bool(getattr(get_plugin_manager().hook, hook_name).get_hookimpls())
