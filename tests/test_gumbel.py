"""The in-graph sampling kernels (engine/gumbel.py) against softmax(logits / T) and torch.argmax.

The reference is the exact distribution: many draws of one row (a batch of identical rows, each drawing its
own noise) must fit softmax(logits / T) by a chi-square test, and the wrong temperature must fail the same
test. On a CUDA machine the kernels run compiled, also captured in a CUDA graph as the decode graphs run
them; on any machine with Triton they also run in Triton's interpreter in a fresh process (see
tests/test_fused_qkv.py for why a fresh process).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from triton_interpreter import interpreter_or_cuda, run_interpreter_cases

CHI2_LIMIT = {7: 29.9, 15: 42.0}  # chi-square quantiles at p = 1e-4 (degrees of freedom -> limit)
# Draws per distribution. The interpreter runs a program in ~20 ms: 300 draws keep the wrong temperature's
# chi-square near 90 (0.31 per draw) against a limit of 29.9, so the tests that check it still fail it.
ROWS = {"cuda": 4000, "cpu": 300}
LOGITS = [1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7]


def test_the_kernels_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=7)


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-interpreter", "cuda"])
def device(request: pytest.FixtureRequest):
    interpreter_or_cuda(request.param)
    return request.param


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(ids.cpu(), minlength=len(probs)).double()
    expected = probs.double() * len(ids)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_draws_follow_softmax_over_temperature(device, temperature):
    from minisgl.engine import gumbel

    if device == "cpu" and temperature != 1.0:
        pytest.skip("the interpreter checks one temperature (a minute per case); a GPU checks them all")

    rows = ROWS[device]
    batch = torch.tensor(LOGITS).repeat(rows, 1).to(device, torch.bfloat16)
    ids = gumbel.sample(batch, torch.full((rows,), temperature, device=device))
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    probs = torch.softmax(batch[0].float().cpu() / temperature, dim=-1)
    assert chi_square(ids, probs) < CHI2_LIMIT[7]
    other = torch.softmax(batch[0].float().cpu() / (temperature / 2), dim=-1)
    assert chi_square(ids, other) > CHI2_LIMIT[7]  # the test can fail: the wrong temperature does


def test_greedy_rows_take_the_first_argmax_and_negative_rows_are_left_alone(device):
    """T = 0: torch.argmax (the first of tied maxima), whatever program holds it; T < 0: out untouched."""
    from minisgl.engine import gumbel

    vocab = 3000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, vocab, generator=gen).to(torch.bfloat16)
    logits[3, [5, 2500]] = 9.0  # a tie across programs: the first column wins
    logits[4, [1100, 1101]] = 9.0  # a tie inside one block
    logits[5] = float("-inf")
    logits[5, vocab - 1] = 0.0  # the last column, in the last (partial) block
    temps = torch.zeros(12)
    temps[[6, 7]] = -1.0
    logits, temps = logits.to(device), temps.to(device)
    ws = gumbel.Workspace(12, vocab, device, max_splits=3)
    out = torch.full((12,), -7, dtype=torch.int64, device=device)
    gumbel.sample_into(logits, temps, out, ws, splits=3)
    expected = logits.float().argmax(dim=-1).cpu()
    expected[[6, 7]] = -7
    assert out.cpu().tolist() == expected.tolist()
    assert out[3].item() == 5 and out[4].item() == 1100 and out[5].item() == vocab - 1


def test_rows_split_over_programs_and_masked_tokens(device):
    """A vocabulary wider than one program's share: each row's winner may sit in any split; -inf never wins."""
    from minisgl.engine import gumbel

    vocab, rows = 5000, ROWS[device] // 3
    logits = torch.full((rows, vocab), float("-inf"))
    hot = torch.tensor([3, 1500, 2600, 4999] + [1024 * i + 7 for i in range(4)])  # across splits and blocks
    logits[:, hot] = torch.linspace(0.0, 1.4, len(hot))
    ids = gumbel.sample(logits.to(device), torch.ones(rows, device=device), splits=5)
    assert set(ids.tolist()) <= set(hot.tolist())
    position = {int(t): i for i, t in enumerate(hot)}
    probs = torch.softmax(logits[0, hot], dim=-1)
    assert chi_square(torch.tensor([position[i] for i in ids.tolist()]), probs) < CHI2_LIMIT[7]


def test_the_step_counter_gives_new_draws_and_replays_reproduce(device):
    """Each call advances the counter on the device (new noise, as a replayed graph needs); the same seed and
    step give the same draws, another seed other ones; rows of one call draw independently."""
    from minisgl.engine import gumbel

    rows, vocab = 64, 64
    logits = torch.zeros(rows, vocab, device=device)  # uniform: every draw is the noise alone
    temps = torch.ones(rows, device=device)
    ws = gumbel.Workspace(rows, vocab, device, seed=3)
    first = torch.empty(rows, dtype=torch.int64, device=device)
    second = torch.empty_like(first)
    gumbel.sample_into(logits, temps, first, ws)
    gumbel.sample_into(logits, temps, second, ws)
    assert ws.step.item() == 2
    assert (first != second).float().mean().item() > 0.9  # 1/64 agree by chance
    assert len(set(first.tolist())) > 30  # rows differ from each other (~40.5 values expected in 64 draws)
    ws.step.zero_()
    again = torch.empty_like(first)
    gumbel.sample_into(logits, temps, again, ws)
    assert torch.equal(again, first)
    other = gumbel.Workspace(rows, vocab, device, seed=4)
    gumbel.sample_into(logits, temps, again, other)
    assert (again != first).float().mean().item() > 0.9


def test_per_row_temperatures(device):
    """Two halves of a batch with different temperatures each follow their own distribution."""
    from minisgl.engine import gumbel

    logits = torch.linspace(-2.0, 2.0, 16)
    rows = ROWS[device]
    temps = torch.tensor([0.5] * (rows // 2) + [3.0] * (rows // 2))
    ids = gumbel.sample(logits.repeat(rows, 1).to(device, torch.float16), temps.to(device)).cpu()
    for half, t in ((ids[: rows // 2], 0.5), (ids[rows // 2 :], 3.0)):
        assert chi_square(half, torch.softmax(logits / t, dim=-1)) < CHI2_LIMIT[15]


def sharded_sample(logits: torch.Tensor, temps: torch.Tensor, shards: int, seed: int = 0) -> list[torch.Tensor]:
    """Each simulated TP rank's ids when each samples its shard of the vocabulary's columns (the last one
    narrower) and the ranks' winners are gathered: every rank runs once with the others' winners as they
    computed them at the same step (recorded in a first pass; the step counters reset in between)."""
    from minisgl.engine import gumbel

    rows, vocab = logits.shape
    width = -(-vocab // shards)
    ranks = [
        gumbel.Workspace(
            rows,
            width,
            logits.device,
            seed=seed,
            shards=shards,
            shard=r,
            col0=r * width,
            gather=lambda out, local: None,
        )
        for r in range(shards)
    ]
    winners: list[torch.Tensor] = []

    def run(r: int, gather) -> torch.Tensor:
        ranks[r].gather = gather
        ranks[r].step.zero_()
        out = torch.full((rows,), -7, dtype=torch.int64, device=logits.device)
        gumbel.sample_into(logits[:, r * width : (r + 1) * width], temps, out, ranks[r])
        return out

    for r in range(shards):  # first pass: each rank's own winners
        run(r, lambda out, local: winners.append(local.clone()))

    def gather(out: torch.Tensor, local: torch.Tensor) -> None:
        out.copy_(torch.cat(winners))

    return [run(r, gather) for r in range(shards)]


def test_sharded_vocabulary_greedy_takes_the_first_argmax_on_every_rank(device):
    """Tensor parallelism: each rank holds a shard of the columns; greedy rows get torch.argmax of the whole row
    (a tie across two ranks' shards: the first column), T < 0 rows are untouched, on every rank alike."""
    vocab = 3001  # shards of 1,001 columns (two shards: 1,501), the last one narrower
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, vocab, generator=gen)
    logits[2, [40, 2900]] = 9.0
    logits[3, vocab - 1] = 9.0
    temps = torch.zeros(9)
    temps[5] = -1.0
    for shards in (2, 3):
        outs = sharded_sample(logits.to(device, torch.bfloat16), temps.to(device), shards)
        expected = logits.to(torch.bfloat16).float().argmax(dim=-1)
        expected[5] = -7
        for out in outs:
            assert out.cpu().tolist() == expected.tolist()
        assert outs[0][2].item() == 40 and outs[0][3].item() == vocab - 1


@pytest.mark.parametrize("temperature", [0.7])
def test_sharded_vocabulary_draws_follow_softmax_and_agree_across_ranks(device, temperature):
    """Each rank draws Gumbel noise for its own columns only; the gathered winners still follow the whole row's
    softmax(logits / T), and every rank picks the same ids."""
    rows = ROWS[device] // 2  # each of the two ranks samples twice
    logits = torch.tensor(LOGITS).repeat(rows, 1)
    outs = sharded_sample(logits.to(device), torch.full((rows,), temperature, device=device), shards=2, seed=5)
    assert torch.equal(outs[0], outs[1])
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    assert chi_square(outs[0], probs) < CHI2_LIMIT[7]
    assert chi_square(outs[0], torch.softmax(logits[0] / (temperature / 2), dim=-1)) > CHI2_LIMIT[7]


def test_replayed_from_a_cuda_graph():
    """As the decode graphs run it: captured once, replayed; every replay draws anew from softmax(logits / T)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        pytest.skip("needs a CUDA GPU and Triton")
    from minisgl.engine import gumbel

    rows, temperature, replays = 500, 0.8, 8
    logits = torch.tensor(LOGITS, device="cuda").repeat(rows, 1).to(torch.bfloat16)
    temps = torch.full((rows,), temperature, device="cuda")
    temps[:3] = 0.0  # greedy rows in the same graph
    ws = gumbel.Workspace(rows, len(LOGITS), "cuda")
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    gumbel.sample_into(logits, temps, out, ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gumbel.sample_into(logits, temps, out, ws)
    draws = []
    for _ in range(replays):
        graph.replay()
        draws.append(out.clone())
    assert ws.step.item() == 1 + replays
    assert all(d[:3].tolist() == [3, 3, 3] for d in draws)
    assert not torch.equal(draws[0], draws[1])
    sampled = torch.cat([d[3:] for d in draws])
    probs = torch.softmax(logits[0].float().cpu() / temperature, dim=-1)
    assert chi_square(sampled, probs) < CHI2_LIMIT[7]
    assert chi_square(sampled, torch.softmax(logits[0].float().cpu() / (temperature / 2), dim=-1)) > CHI2_LIMIT[7]
