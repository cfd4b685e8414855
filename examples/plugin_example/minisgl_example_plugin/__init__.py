"""An example minisgl plugin, loaded from the "minisgl" entry-point group.

It registers the architecture "ExampleLlamaForCausalLM" (a checkpoint whose config.json names
it loads through this plugin) and counts finished requests with a lifecycle hook.
"""

from __future__ import annotations

from typing import Any

from minisgl.hooks import hookimpl

finished_requests: list[str] = []


def _example_llama() -> type:
    from minisgl.models.llama import LlamaForCausalLM

    class ExampleLlamaForCausalLM(LlamaForCausalLM):
        """Llama with a different name: what a plugin for a new family starts from."""

    return ExampleLlamaForCausalLM


@hookimpl
def minisgl_register_architectures() -> dict[str, type]:
    return {"ExampleLlamaForCausalLM": _example_llama()}


@hookimpl
def minisgl_request_finished(req: Any) -> None:
    finished_requests.append(req.rid)
