"""Prefill admission's in-batch sharing check against its definition, computed by brute force.

A fresh request waits a step when a prompt already admitted to the batch shares at least `width` of its
tokens past its cached prefix (the last token excluded, whole pages only): it then reads them from the cache
instead of computing them twice. BatchPrefixes answers that with a dict look-up; the reference compares the
request with every admitted prompt.
"""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.kvcache.radix import RadixCache
from minisgl.scheduler.prefill import BatchPrefixes


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def waits_by_definition(ids: list[int], cached: int, admitted: list[list[int]], width: int, page_size: int) -> bool:
    shared = max((lcp(ids, other) for other in admitted), default=0)
    shared = min(shared, len(ids) - 1) // page_size * page_size
    return shared - cached >= width


def random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts built from a few shared stems (some of them cached), a small vocabulary: many partial overlaps."""
    stems = [[rng.randrange(4) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    prompts = []
    for _ in range(count):
        prompt = list(rng.choice(stems))
        if rng.random() < 0.5 and prompts:  # extend an earlier prompt: a long shared prefix
            prompt = list(rng.choice(prompts)[: rng.randrange(1, 60)])
        prompt += [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        prompts.append(prompt)
    return prompts


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(40))
def test_batch_prefixes_agree_with_comparing_every_admitted_prompt(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    width = -(-16 // page_size) * page_size
    cache = RadixCache(page_size)
    for prompt in random_prompts(rng, 6):  # what earlier requests left in the cache
        n = len(prompt) // page_size * page_size
        cache.insert(prompt[:n], torch.arange(n))
    index = BatchPrefixes(width, page_size)
    admitted: list[list[int]] = []
    for ids in random_prompts(rng, 30):
        cached = cache.match_len(ids[:-1])
        want = waits_by_definition(ids, cached, admitted, width, page_size)
        assert index.extends(ids, cached) == want, (ids, cached)
        if not want:
            admitted.append(ids)
            index.add(ids, cached)


def test_an_agent_turn_burst_admits_everyone_and_a_shared_new_prefix_waits() -> None:
    """Turns of different agents share only the cached system prompt: none waits. Two fresh prompts with the
    same uncached 40-token head: the second waits for the first to cache it."""
    system = list(range(100, 300))
    cache = RadixCache(1)
    cache.insert(system, torch.arange(len(system)))
    index = BatchPrefixes(16, 1)
    for agent in range(8):
        turn = system + [1000 + agent] * 30
        assert not index.extends(turn, cache.match_len(turn[:-1]))
        index.add(turn, cache.match_len(turn[:-1]))
    head = list(range(5000, 5040))
    first, second = head + [1, 2, 3], head + [7, 8]
    assert not index.extends(first, 0)
    index.add(first, 0)
    assert index.extends(second, 0)
