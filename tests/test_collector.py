"""The garbage collector in a scheduler's process (scheduler/collector.py): after take_over() collections run only at
the scheduler's safe point, by CPython's own documented thresholds, and still free cyclic garbage."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler import collector


@pytest.fixture
def managed():
    thresholds = gc.get_threshold()
    collector.take_over()
    runs: list[tuple[int, bool]] = []  # (generation, called from collect_due)

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            frame, inside = sys._getframe(1), False
            while frame is not None and not inside:
                inside = frame.f_code is collector.collect_due.__code__
                frame = frame.f_back
            runs.append((info["generation"], inside))

    gc.callbacks.append(callback)
    try:
        yield runs
    finally:
        gc.callbacks.remove(callback)
        collector.release()
        gc.set_threshold(*thresholds)
    assert gc.isenabled() and not collector.is_managed() and gc.get_freeze_count() == 0


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_no_collection_runs_until_collect_due_then_the_generations_follow_cpythons_thresholds(managed):
    # gc.set_threshold's documentation: a collection starts when allocations minus deallocations exceed threshold0;
    # generation 1 is examined as well once generation 0 has been examined more than threshold1 times since.
    gc.set_threshold(200, 3, 1000)
    keep = []
    generations = []
    for _ in range(10):
        assert collector.collect_due() is None  # nothing is due yet
        keep.extend([] for _ in range(250))
        assert managed == [], "the collector ran on its own"
        generations.append(collector.collect_due())
        assert [g for g, _ in managed] == [generations[-1]] and managed[0][1]
        managed.clear()
    assert generations == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_a_deferred_collection_waits_until_the_young_generation_is_ten_times_its_threshold(managed):
    gc.set_threshold(50, 10, 10)
    keep = [[] for _ in range(100)]
    assert collector.collect_due(defer=True) is None and managed == []
    keep += [[] for _ in range(450)]  # 550 young containers: past 10 x 50
    assert collector.collect_due(defer=True) == 0 and len(managed) == 1


def test_cyclic_garbage_is_freed_at_the_safe_point(managed):
    gc.set_threshold(100, 10, 10)
    freed = []
    garbage = Cycle()
    weakref.finalize(garbage, freed.append, True)
    del garbage
    keep = [[] for _ in range(150)]
    assert not freed  # no automatic collection: the cycle is still there
    assert collector.collect_due() == 0
    assert freed == [True] and len(keep) == 150


def test_a_scheduler_collects_only_at_its_safe_point(tiny_model_dir, managed):
    gc.set_threshold(100, 10, 10)  # several collections in a short run
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", max_prefill_tokens=64)
    managed.clear()  # the engine's start-up
    prompts = [[10 + i, 20 + i, 30 + i] * (5 + i) for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [24] * 12
    assert managed, "no collection ran: the safe point never collected"
    assert all(inside for _, inside in managed), f"collections outside collect_due: {managed}"
    llm.check_integrity()


def test_without_take_over_collect_due_does_nothing():
    assert not collector.is_managed() and gc.isenabled()
    assert collector.collect_due() is None
