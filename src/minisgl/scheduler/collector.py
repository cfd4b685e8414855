"""Python's garbage collector in a process that hosts one scheduler for the rest of its life: the daemon's scheduler
worker, a tensor-parallel rank, `minisgl bench agents`.

`take_over()` collects, then moves every object alive after start-up (the engine, torch, transformers: ~466k on an
H100 host) out of the collector's reach, as vLLM's engine core does: a full collection had walked them all, ~0.3 s
with the GPU's feed stopped (measured on one H100).

It also turns automatic collection off. CPython collects its young generation when 700 more containers were allocated
than freed, wherever that happens: in the middle of a burst of submits or of a prefill admission, while the GPU waits
for the host. Agent prompts are ~3,300-token lists, and a young-generation pass visits every element of every young
list: 1.5-3.5 ms a pass on a fast host, twice that on a slow one. The scheduler calls `collect_due()` instead right
after it has launched a forward, while the GPU computes it and the host would only wait for the previous step's
tokens, and when it is idle; while prefill chunks wait to be admitted (a burst) it waits for the decode steps, where
the host has slack. The same passes run, by the same thresholds (gc.get_threshold()); only where they run
changes. A process that did not call take_over() (an `LLM` in a user's program) keeps automatic collection.
"""

from __future__ import annotations

import gc

_managed = False
# A deferred collection runs anyway once the young generation is this many times its threshold.
DEFER_LIMIT = 10


def take_over() -> None:
    """Freeze the start-up heap; from now on collections run at the scheduler's safe points (collect_due)."""
    global _managed
    gc.collect()
    gc.freeze()
    gc.disable()
    _managed = True


def release() -> None:
    """Automatic collection again, over every object (the frozen ones too: a benchmark that starts a second engine in
    the same process can then collect the first one's cycles)."""
    global _managed
    _managed = False
    gc.unfreeze()
    gc.enable()


def is_managed() -> bool:
    return _managed


def collect_due(defer: bool = False) -> int | None:
    """Run the collection CPython would have run by now, if any; returns its generation (None: none was due).

    CPython's rule: when the young generation's count passes its threshold, collect the oldest generation whose count
    passed its threshold (its counts: net allocations, then collections of the generation below since its last one).
    defer: the host is on the critical path now (prefill chunks back to back: the next chunk's admission and launch
    take about as long as the GPU's chunk on a slow host), so wait for a decode step or idle time, unless the young
    generation has grown to DEFER_LIMIT times its threshold.
    """
    if not _managed:
        return None
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if thresholds[0] == 0 or counts[0] <= thresholds[0] * (DEFER_LIMIT if defer else 1):  # 0: collection is off
        return None
    generation = next(g for g in (2, 1, 0) if g == 0 or counts[g] > thresholds[g])
    gc.collect(generation)
    return generation
