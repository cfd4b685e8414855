"""The example plugin (examples/plugin_example, installed by scripts/install.sh) loads via entry points."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from minisgl import LLM, SamplingParams, plugins
from minisgl.errors import EngineError
from minisgl.hooks import hookimpl

plugin = pytest.importorskip(
    "minisgl_example_plugin", reason="install it: pip install --no-deps -e examples/plugin_example"
)


def test_example_plugin_registers_an_architecture_and_a_lifecycle_hook(tiny_model_dir, tmp_path):
    assert "ExampleLlamaForCausalLM" in plugins.architectures()
    src = tiny_model_dir("llama")
    dst = tmp_path / "example-arch"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["ExampleLlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[11, 12, 13, 14], [20, 21]]
    custom = LLM(str(dst))
    assert type(custom.scheduler.engine.model).__name__ == "ExampleLlamaForCausalLM"
    before = len(plugin.finished_requests)
    got = custom.generate(prompts, params, use_tqdm=False)
    assert len(plugin.finished_requests) == before + 2
    # Same weights through the built-in Llama: the plugin's model computes the same thing.
    ref = LLM(str(src)).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


class _RaisingFinishedHook:
    """A plugin whose request-finished observer raises."""

    @staticmethod
    @hookimpl
    def minisgl_request_finished(req):
        raise RuntimeError("observer bug")


def test_a_raising_request_finished_hook_fails_only_its_request(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    ref = llm.generate([[11, 12, 13]], params, use_tqdm=False)
    pm = plugins.get_plugin_manager()
    pm.register(_RaisingFinishedHook, name="raising-finished")
    try:
        llm.scheduler._hook_finished = True  # the scheduler looked hooks up when it was built
        with pytest.raises(EngineError, match="minisgl_request_finished hook failed: RuntimeError: observer bug"):
            llm.generate([[11, 12, 13]], params, use_tqdm=False)  # n=2: both sequences finish through the hook
    finally:
        pm.unregister(name="raising-finished")
        llm.scheduler._hook_finished = plugins.has_impl("minisgl_request_finished")
    assert not llm.scheduler.has_work and llm.scheduler.req_pages() == 0  # nothing left running, no page leaked
    again = llm.generate([[11, 12, 13]], params, use_tqdm=False)  # the engine goes on
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]


class _StepRecorder:
    """A profiler-like plugin of the step hooks: each step's kind, tokens and host seconds, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, list[int], float]] = []

    @hookimpl
    def minisgl_step_scheduled(self, batch, schedule_s):
        self.calls.append(("scheduled", batch.is_prefill, list(batch.extend_lens), schedule_s))

    @hookimpl
    def minisgl_step_launched(self, batch, launch_s):
        self.calls.append(("launched", batch.is_prefill, list(batch.extend_lens), launch_s))
        raise RuntimeError("observer bug")  # logged: the step goes on


def test_step_hooks_see_every_forward_once_with_its_tokens_and_host_seconds(tiny_model_dir):
    prompt, max_tokens = list(range(11, 21)), 5
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = LLM(str(tiny_model_dir("llama")), max_prefill_tokens=4).generate([prompt], params, use_tqdm=False)
    recorder = _StepRecorder()
    pm = plugins.get_plugin_manager()
    pm.register(recorder, name="step-recorder")
    try:
        llm = LLM(str(tiny_model_dir("llama")), max_prefill_tokens=4)  # looks the hooks up when built
        t0 = time.perf_counter()
        got = llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        pm.unregister(name="step-recorder")
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]  # the raising observer changed nothing
    assert [c[0] for c in recorder.calls] == ["scheduled", "launched"] * (len(recorder.calls) // 2)
    steps = recorder.calls[::2]
    assert [c[1:3] for c in recorder.calls[1::2]] == [c[1:3] for c in steps]  # each launch is the batch scheduled
    prefill = [n for _, is_prefill, lens, _ in steps if is_prefill for n in lens]
    assert sum(prefill) == len(prompt) and max(prefill) <= 4  # the prompt in chunks of the prefill budget
    decode = [lens for _, is_prefill, lens, _ in steps if not is_prefill]
    assert decode == [[1]] * (max_tokens - 1)  # the prefill's forward samples the first token
    seconds = [c[3] for c in recorder.calls]
    assert min(seconds) >= 0 and sum(seconds) <= wall
