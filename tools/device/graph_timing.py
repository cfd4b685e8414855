"""Microseconds per call of a GPU function replayed from a CUDA graph, for the tools/device microbenchmarks
(imported by the scripts beside it: `from graph_timing import graph_us`)."""

from __future__ import annotations

from typing import Callable

import torch


def graph_us(fn: Callable[[], object], reps: int = 50) -> float:
    """fn captured `reps` times into one CUDA graph (after three warm-up calls on a side stream), the best of five
    replays, per call: launch costs as in a decode step replayed from its graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best
