"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 token for token; rank failures are loud."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from minisgl import LLM, SamplingParams
from minisgl.layers.moe import FusedMoE
from minisgl.runtime.ranks import RankFailedError, free_port

PROMPTS = [[11, 12, 13, 14, 15], list(range(100, 160)), [7, 8, 9], list(range(300, 321))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tp1_tokens(model_dir) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(model_dir)).generate(PROMPTS, GREEDY, use_tqdm=False)]


# mistral's tiny checkpoint has 1 KV head: with tp=2 the KV head is replicated on both ranks.
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_tp2_greedy_equals_tp1(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    ref = tp1_tokens(model_dir)
    with LLM(str(model_dir), tp=2, dist_timeout=60) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        llm.check_integrity()
    assert got == ref


@pytest.mark.parametrize(("family", "layout"), [("qwen3_moe", "tp"), ("mixtral", "tp"), ("qwen2_moe", "ep")])
def test_tp2_moe_layouts_greedy_equal_tp1(tiny_model_dir, family, layout):
    """moe_parallel="tp": each rank holds every expert with half its intermediate dimension; "ep" (what "auto", the
    default, picks for 8 experts over 2 ranks): each rank holds 4 of the 8 experts whole (Qwen2-MoE's shared expert
    stays split)."""
    model_dir = tiny_model_dir(family)
    ref = tp1_tokens(model_dir)
    with LLM(str(model_dir), tp=2, moe_parallel=layout, dist_timeout=60) as llm:
        config = json.loads((model_dir / "config.json").read_text())
        inter = config.get("moe_intermediate_size", config["intermediate_size"])
        want = (8, inter // 2) if layout == "tp" else (4, inter)  # rank 0's experts and the slice of I of each
        moes = [m for m in llm.scheduler.engine.model.modules() if isinstance(m, FusedMoE)]
        assert moes and all((m.gate_up_proj.shape[0], m.gate_up_proj.shape[1] // 2) == want for m in moes)
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        llm.check_integrity()
    assert got == ref


def test_a_prefix_cache_reset_reaches_every_rank(tiny_model_dir):
    """After reset_prefix_cache every rank recomputes the prompt: the ranks still build the same batches."""
    model_dir = tiny_model_dir("llama")
    ref = tp1_tokens(model_dir)
    with LLM(str(model_dir), tp=2, dist_timeout=30) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref
        llm.reset_prefix_cache()
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in again] == ref
        assert all(o.cached_tokens == 0 for o in again)  # nothing served from a cache that was reset
        # Prompt logprobs bypass the (now warm) cache on every rank alike, and agree with TP=1's.
        scored = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        embedded = llm.embed(PROMPTS)  # the add op carries the embed flag to every rank
        llm.check_integrity()
    one = LLM(str(model_dir))
    single = one.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for got, want in zip(embedded, one.embed(PROMPTS)):
        assert got == pytest.approx(want, abs=1e-4)
    for got, want in zip(scored, single):
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
        assert [e[0] for e in got.prompt_logprobs[1:]] == pytest.approx(
            [e[0] for e in want.prompt_logprobs[1:]], abs=1e-4
        )


def test_a_request_waiting_for_its_grammar_reaches_every_rank_at_the_same_step(tiny_model_dir):
    """With grammars compiled off the loop (the daemon's way), rank 0 sends a constrained request to the other
    ranks at the step it queues it: the ranks keep building the same batches, and the output equals TP=1's."""
    model_dir = tiny_model_dir("llama")
    regex = SamplingParams(regex="[0-9]{2,30}x", max_tokens=40, temperature=0)
    want = [o.token_ids for o in LLM(str(model_dir)).generate([PROMPTS[0], PROMPTS[1]], [regex, GREEDY])]
    with LLM(str(model_dir), tp=2, dist_timeout=60) as llm:
        sched = llm.scheduler
        sched.defer_grammars = True
        sched.add_request("regex", PROMPTS[0], regex)
        sched.add_request("plain", PROMPTS[1], GREEDY)
        got: dict[str, list[int]] = {"regex": [], "plain": []}
        finished: set[str] = set()
        deadline = time.monotonic() + 120
        while finished != set(got) and time.monotonic() < deadline:
            for out in sched.step() if sched.has_work else []:
                got[out.rid] += out.new_token_ids
                if out.finished:
                    assert out.error is None, out.error
                    finished.add(out.rid)
            time.sleep(0 if sched.has_work else 0.005)
        llm.check_integrity()
    assert [got["regex"], got["plain"]] == want


def test_an_idle_engine_outlives_the_dist_timeout(tiny_model_dir):
    """The ranks wait for rank 0 in a broadcast with dist_timeout; rank 0 pings them while idle."""
    model_dir = tiny_model_dir("llama")
    ref = tp1_tokens(model_dir)
    with LLM(str(model_dir), tp=2, dist_timeout=10) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref
        time.sleep(25)  # 2.5x the timeout with no request
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref
        assert all(w.poll() is None for w in llm.scheduler.workers)
    assert all(w.returncode == 0 for w in llm.scheduler.workers)


def test_a_dead_rank_stops_the_engine_with_a_clear_error(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), tp=2, dist_timeout=20)
    try:
        llm.scheduler.workers[0].kill()
        llm.scheduler.workers[0].wait()
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match="exited"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 20
    finally:
        t0 = time.monotonic()
        llm.shutdown()  # with a dead peer: bounded, and nothing of this engine outlives it
        assert time.monotonic() - t0 < 30
        assert not llm.scheduler._monitor.is_alive()


@pytest.mark.parametrize("idle", [False, True], ids=["mid-stream", "idle"])
def test_a_killed_rank_stops_the_daemon_with_a_typed_error(tiny_model_dir, tmp_path, idle):
    """`minisgl serve --tp 2`: SIGKILL rank 1 while a stream runs (the client gets a typed error) or while nothing
    runs; the daemon exits non-zero and nothing of its process session outlives it, in bounded time (no hang)."""
    from minisgl.bench.tp import kill_rank_check

    log = tmp_path / "daemon.log"
    r = kill_rank_check(
        tiny_model_dir("llama"),
        ["--device", "cpu", "--dist-timeout", "20"],
        log,
        start_timeout=180,
        exit_timeout=60,
        idle=idle,
    )
    assert r["served_before_kill"] and r["rank_processes"] == 1, (r, log.read_text()[-3000:])
    if not idle:
        assert r["stream_error"] is not None and "rank" in r["stream_error"], r
        assert r["seconds_to_stream_error"] < 30, r
    assert r["daemon_exit"] not in (0, "still running"), r
    assert r["seconds_to_daemon_exit"] < 30, r
    assert "RankFailedError" in log.read_text(), log.read_text()[-3000:]
    assert r["left_behind"] == [], r


STUCK_SCRIPT = """
import os, signal, sys, threading
from minisgl import LLM, SamplingParams
from minisgl.runtime import ranks as launch
launch.STUCK_EXIT_S = 2.0
llm = LLM(sys.argv[1], tp=2, device="cpu", dist_timeout=60)
sched = llm.scheduler

def stuck_step():  # what a symmetric-memory all-reduce does once its peer is gone: wait forever
    os.kill(sched.workers[0].pid, signal.SIGKILL)
    threading.Event().wait()

sched.sched.step = stuck_step
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
print("the stuck step came back")
"""


def test_a_step_stuck_after_a_rank_died_ends_the_process_loudly(tiny_model_dir):
    """A kernel that waits for a dead peer forever (no abort reaches it) must not hang rank 0's process: the
    failure watch ends it with the reason, so the daemon above it reports the failure."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", STUCK_SCRIPT, str(tiny_model_dir("llama"))], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-3000:])
    assert "has not come back" in proc.stderr and "rank(s) [1] exited" in proc.stderr, proc.stderr[-3000:]
    assert "came back" not in proc.stdout
    assert time.monotonic() - t0 < 90


def test_two_nodes_on_one_machine_match_single_node(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    ref = tp1_tokens(model_dir)
    addr = f"127.0.0.1:{free_port()}"
    secret = tmp_path / "tp.secret"  # the nodes authenticate each other with it
    secret.write_text("a shared secret of two nodes\n")
    secret.chmod(0o600)
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisgl",
            "serve",
            "--model",
            str(model_dir),
            "--tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            addr,
            "--device",
            "cpu",
            "--dist-timeout",
            "60",
            "--tp-secret-file",
            str(secret),
        ],
        env={**os.environ},
    )
    try:
        with LLM(
            str(model_dir),
            tp=2,
            nnodes=2,
            node_rank=0,
            dist_init_addr=addr,
            device="cpu",
            dist_timeout=60,
            tp_secret_file=str(secret),
        ) as llm:
            got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == ref
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_tp2_ranks_follow_rank_zeros_prefill_budget(tiny_model_dir):
    """A long prompt chunked beside decoding requests under a tight max_decode_gap: rank 0 alone measures step times
    and its budget's state reaches the other rank with each step's ops, so both build the same (small) chunks and
    the tokens equal TP=1's without a budget."""
    model_dir = tiny_model_dir("llama")
    prompts = [[11, 12, 13], list(range(20, 420)), [7, 8, 9, 10]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(model_dir), max_prefill_tokens=64, max_decode_gap=0) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with LLM(str(model_dir), tp=2, dist_timeout=60, max_prefill_tokens=64, max_decode_gap=0.001) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        budget = llm.scheduler.sched.prefill_budget
        assert budget.decode_s > 0 and budget.cost.a is not None  # it measured decodes and prefill chunks
        assert llm.scheduler._budget_sent is not None and llm.scheduler._budget_sent[0] == 0.001  # shared
        llm.check_integrity()
    assert got == ref
