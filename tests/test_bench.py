"""The benchmarks run end to end (small sizes; the figures themselves live in docs/benchmarks.md)."""

from __future__ import annotations

import json
import re

import pytest

from minisgl.bench import main


def test_bench_offline_runs_and_reports_throughput(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    main(
        [
            "offline",
            "--model",
            str(tiny_model_dir("llama")),
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--repeat",
            "2",
            "--json",
            str(out),
        ]
    )
    assert "tok/s" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert len(res["minisgl_runs_s"]) == 2  # the best of the runs is reported
    assert abs(res["minisgl_seconds"] - min(res["minisgl_runs_s"])) < 0.01


def test_bench_agents_radix_beats_naive_on_cached_tokens(tiny_model_dir, tmp_path):
    import json

    out = tmp_path / "agents.json"
    main(
        [
            "agents",
            "--model",
            str(tiny_model_dir("llama")),
            "-k",
            "3",
            "-t",
            "2",
            "--system-len",
            "64",
            "--tool-len",
            "8",
            "--output-len",
            "4",
            "--json",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert res["naive"]["cached_tokens"] == 0
    # Agents share the system prompt and their own history: radix serves most of it from the cache.
    assert res["radix"]["hit_ratio_of_max"] >= 0.9
    assert res["radix"]["prefill_tokens_computed"] < res["naive"]["prefill_tokens_computed"]


BENCH_SUBCOMMANDS = ("offline", "online", "agents", "hf-generate", "routing", "throughput", "tp", "profile")


def test_bench_help_lists_every_subcommand_and_each_has_its_own_help(capsys):
    from minisgl.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--help"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    for name in BENCH_SUBCOMMANDS:
        assert name in listed
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: minisgl bench {name}" in capsys.readouterr().out


def test_bench_hf_generate_patched_greedy_fp32_equals_transformers_row_for_row(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "hf.json"
    main(
        [
            "hf-generate",
            "--model",
            str(tiny_model_dir("llama")),
            "--device",
            "cpu",
            "--num-prompts",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--repeat",
            "2",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    # transformers' own generate is the reference: greedy fp32 on the same weights agrees on every row.
    speedup, rows = re.search(r"speedup ([\d.]+)x; identical rows (\d+)/(\d+)", printed).group(1, 2)
    res = json.loads(out.read_text())
    assert rows == "2" and res["identical_rows"] == "2/2" and res["same_outputs"]
    assert res["answer_tokens"] == 2 * 4  # EOS masked: exactly output_len new tokens per prompt
    assert float(speedup) == res["speedup"] > 0
    assert len(res["hf_runs_s"]) == len(res["minisgl_runs_s"]) == 2
    assert abs(res["hf_seconds"] - min(res["hf_runs_s"])) < 0.01  # the best run is reported


def test_bench_profile_cpu_gemm_reports_positive_gflops_for_every_shape(capsys):
    main(["profile", "cpu-gemm", "--rows", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[1] for r in rows] == ["576x960", "576x576", "576x3072", "1536x576", "576x49152"]
    for r in rows:
        assert r[0] == "1" and all(float(x) > 0 for x in r[2:5])


def test_bench_profile_cpu_step_replays_a_full_decode_batch(tiny_model_dir, capsys):
    main(["profile", "cpu-step", "--model", str(tiny_model_dir("llama")), "--replays", "3"])
    printed = capsys.readouterr().out
    batch, best, median = re.search(r"decode step, batch (\d+): best ([\d.]+) ms, median ([\d.]+) ms", printed).groups()
    assert int(batch) == 32  # every one of the 32 prompts still decodes at the 30th decode step
    assert 0 < float(best) <= float(median)
    assert "Self CPU" in printed  # the torch.profiler table follows


@pytest.mark.slow  # two daemons start: ~25 s on 2 cores
def test_bench_routing_cache_aware_serves_each_later_turn_from_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINISGL_RUNTIME_DIR", str(tmp_path))  # the bench points its daemons here; restored after
    out = tmp_path / "routing.json"
    main(
        [
            "routing",
            "--model",
            str(tiny_model_dir("llama")),
            "--num-pages",
            "2048",
            "--agents",
            "2",
            "--agent-types",
            "2",
            "--turns",
            "2",
            "--system-words",
            "40",
            "--result-words",
            "10",
            "--max-tokens",
            "2",
            "--think-ms",
            "0",
            "--json",
            str(out),
        ]
    )
    res = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    for r in res.values():
        assert r["requests"] == 4 and sum(r["per_daemon"].values()) == 4
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
    # Turn 2 resends turn 1's whole prompt: routed to the daemon that served turn 1, it is a cache hit.
    aware = res["cache-aware"]
    assert aware["hit_ratio"] > 0.3
    assert aware["hit_ratio"] >= res["round-robin"]["hit_ratio"]


def test_bench_tp_gen_tp2_greedy_fp32_equals_transformers(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from minisgl.bench.tp import parity_prompts

    model_dir, out = tiny_model_dir("llama"), tmp_path / "tp2.json"
    # `gen` leaves through os._exit once its figures are written: run it as the benchmark does, in a child.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl",
            "bench",
            "tp",
            "gen",
            "--model-dir",
            str(model_dir),
            "--tp",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-prompts",
            "2",
            "--max-new",
            "4",
            "--out",
            str(out),
        ],
        check=True,
        timeout=120,
    )
    tokens = json.loads(out.read_text())["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, got in zip(parity_prompts(2), tokens, strict=True):
        want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4, min_new_tokens=4)
        assert got == want[0, len(prompt) :].tolist()


def test_throughput_timing_counts_the_garbage_collectors_time(tiny_model_dir):
    """The throughput benchmark's timed run reports Python's GC time and full collections (gc_s, gc_full)."""
    import gc

    from minisgl import LLM
    from minisgl.bench.throughput import GcTimer, timed_workload

    with GcTimer() as timer:
        gc.collect()
    assert timer.full == 1 and timer.seconds > 0
    assert timer._callback not in gc.callbacks

    llm = LLM(str(tiny_model_dir("llama")))
    res = timed_workload(llm, llm.scheduler, ([[11, 12, 13], [14, 15]], [5, 7]))
    assert res["output_tokens"] == 12 and res["gc_full"] >= 0 and res["gc_s"] >= 0


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_throughput_floor_counts_the_weights_hf_builds_for_the_shape(shape):
    """The bandwidth floor's bytes per decode step against the parameters transformers builds for the same config
    (on the meta device): the experts' weights and everything else that a step reads (the LM head, not the
    embedding, which is gathered)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.bench.throughput import SHAPES, bandwidth_floor

    config = AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # a tied LM head is listed once, as the embedding
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    dense = sum(p.numel() for n, p in params.items() if ".experts." not in n)
    if not config.tie_word_embeddings:
        dense -= params["model.embed_tokens.weight"].numel()
    floor = bandwidth_floor(1e12, SHAPES[shape])
    assert floor["weight_bytes_per_step_gb"] == round(2 * dense / 1e9, 3)
    assert floor.get("expert_bytes_all_gb", 0) == round(2 * experts / 1e9, 3)


def test_bench_offline_repeat_alternates_the_sides():
    from minisgl.bench.offline import alternating_runs

    calls: list[str] = []
    timings = alternating_runs(
        {
            "a": (lambda: calls.append("a") or len(calls), lambda: calls.append("setup-a")),
            "b": (lambda: calls.append("b") or len(calls), None),
        },
        3,
    )
    assert calls == ["setup-a", "a", "b"] * 3
    assert [len(timings[s][0]) for s in "ab"] == [3, 3] and (timings["a"][1], timings["b"][1]) == (8, 9)


def test_bench_cpu_prints_medians_ratios_to_fp32_and_int8_agreement(tiny_model_dir, tmp_path, capsys):
    from minisgl.layers.linear import CpuGemm

    if not CpuGemm.supports("int8"):
        pytest.skip("no fbgemm int8 kernels in this torch/CPU")
    out = tmp_path / "cpu.json"
    model = str(tiny_model_dir("llama"))
    args = ["cpu", "--model", model, "--modes", "fp32,int8", "--reps", "3", "--tokens", "4", "--concurrency", "2"]
    main([*args, "--no-hf", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows["fp32"]["vs_fp32"] == 1.0 and rows["fp32"]["agreement"] is None
    int8 = rows["int8"]
    assert len(int8["single_runs"]) == 3 and int8["single"] == sorted(int8["single_runs"])[1]  # the median
    assert int8["vs_fp32"] == pytest.approx(int8["single"] / rows["fp32"]["single"])
    assert 0.0 <= int8["agreement"] <= 1.0 and int8["batched"] > 0
    assert 0 <= int8["chat_same_prefix"] <= 32 and 0 <= int8["chat_same_answers"] <= 8  # greedy chat answers
    assert "load average" in capsys.readouterr().out


def test_tp_profile_of_one_rank_writes_its_summary_table_and_timeline(tiny_model_dir, tmp_path):
    """`bench tp --profile` profiles TP=1 too (the comparison for TP=2's ranks): a per-step summary, torch's table and
    a gzipped Chrome-trace timeline of the same steps."""
    import gzip

    from minisgl import LLM
    from minisgl.bench.tp_support import profile_steps

    with LLM(str(tiny_model_dir("qwen3")), device="cpu", dtype="float32") as llm:
        summary = profile_steps(llm, str(tmp_path), batch=4, prompt_len=16, steps=4)["rank0"]
    assert summary["steps"] == 4 and summary["wall_ms_per_step"] > 0 and summary["ops_wait_ms_per_step"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank0.trace.json.gz", "rank0.txt"]
    assert len(json.loads((tmp_path / "rank0.json").read_text())["step_ms"]) == 4
    with gzip.open(tmp_path / "rank0.trace.json.gz") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the steps' torch ops, timed


def test_agents_profile_tool_accounts_for_every_token_through_the_step_hooks(tiny_model_dir, tmp_path, capsys):
    """tools/device/agents_profile.py on the CPU: its steps, seen through the plugin hooks, add up to the tokens the
    workload's own outputs report (prefill computed = prompt - cached; one decode token per output after the first)."""
    import runpy
    from pathlib import Path

    from minisgl import plugins

    tool = runpy.run_path(str(Path(__file__).parents[1] / "tools/device/agents_profile.py"), run_name="agents_profile")
    out = tmp_path / "profile.json"
    k, t = 2, 2
    argv = ["--model", str(tiny_model_dir("llama")), "--device", "cpu", "-k", str(k), "-t", str(t)]
    tool["main"]([*argv, "--system-len", "32", "--tool-len", "8", "--output-len", "4", "--timeline", "1"])
    tool["main"]([*argv, "--system-len", "32", "--tool-len", "8", "--output-len", "4", "--out", str(out)])
    assert not plugins.get_plugin_manager().has_plugin("agents-profile")  # unregistered after the run
    printed = capsys.readouterr().out
    assert "TTFT by turn (ms): turn 0: n 2" in printed and "turn 1: submits over" in printed
    res = json.loads(out.read_text())
    summary, steps = res["summary"], res["steps"]
    assert sum(s["tokens"] for s in steps if s["prefill"]) == summary["prefill_tokens_computed"]
    assert sum(s["tokens"] for s in steps if not s["prefill"]) == summary["output_tokens"] - k * t
    assert len(res["ttft_s"]) == k * t and all(v > 0 for v in res["ttft_s"].values())
    assert all(s["schedule_s"] >= 0 and s["launch_s"] > 0 for s in steps)
    assert sum(r["steps"] for r in res["by_kind"].values()) == len(steps)


def test_latency_runs_reports_the_median_and_every_run(monkeypatch):
    from minisgl.bench import throughput

    measured = iter([{"decode_ms_per_token_bs1": v, "ttft_ms_bs1": 10 - v} for v in (1.3, 1.1, 1.2)])
    monkeypatch.setattr(throughput, "decode_latency", lambda llm, run: next(measured))
    result = throughput.latency_runs(object(), 3)
    assert result["decode_ms_per_token_bs1"] == 1.2 and result["ttft_ms_bs1"] == 8.8
    assert result["decode_ms_per_token_bs1_runs"] == [1.3, 1.1, 1.2]


def test_bench_tp_tput_repeat_takes_each_configs_median_run_in_turn(tmp_path, monkeypatch, capsys):
    """`bench tp all --stages tput --repeat 3`: TP=1, TP=2 and each --tp2-env run in turn three times; each figure is
    its median run (latency included), the speedup the ratio of the medians, the profile the first round's."""
    import argparse
    import statistics

    from minisgl.bench import tp_stages
    from minisgl.bench.tp_report import print_table

    tok_s = {"1": [100.0, 120.0, 110.0], "2": [190.0, 170.0, 180.0], "2x": [150.0, 210.0, 200.0]}
    calls: list[tuple[str, bool]] = []

    def fake_run_child(cmd, timeout, env=None, log=None):
        tp = cmd[cmd.index("--tp") + 1] + ("x" if env and "X" in env else "")
        calls.append((tp, "--profile-dir" in cmd))
        value = tok_s[tp][sum(1 for c in calls if c[0] == tp) - 1]
        lines = [f"RESULT {json.dumps(dict(output_tok_s=value, seconds=1.0, kv_pages=8, init_s=1.0))}"]
        lines.append(f"LATENCY {json.dumps(dict(decode_ms_per_token_bs1=value / 100))}")
        return 0, "\n".join(lines)

    monkeypatch.setattr(tp_stages, "run_child", fake_run_child)
    tok = tmp_path / "tok"
    tok.mkdir()
    args = argparse.Namespace(
        shape="qwen3-14b", tokenizer_dir=str(tok), num_requests=4, tp2_env="X=1", repeat=3, latency=True,
        profile=False, bench_timeout=10,
    )  # fmt: skip
    res: dict = {}
    tp_stages.stage_tput(args, tmp_path, res, tmp_path / "log")
    assert [c[0] for c in calls] == ["1", "2", "2x"] * 3
    t = res["tput"]
    for key, tp in (("tp1", "1"), ("tp2", "2"), ("tp2 X=1", "2x")):
        assert t[key]["output_tok_s"] == statistics.median(tok_s[tp])
        assert t[key]["decode_ms_per_token_bs1"] == statistics.median(tok_s[tp]) / 100
        assert sorted(t[key]["output_tok_s_runs"]) == sorted(tok_s[tp])
    assert t["speedup"] == round(180.0 / 110.0, 2) and t["tp2 X=1"]["speedup"] == round(200.0 / 110.0, 2)
    print_table(res)
    assert "median of 3: 170-190" in capsys.readouterr().out
