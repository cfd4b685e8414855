"""The benchmarks run end to end (small sizes; the figures themselves live in docs/benchmarks.md)."""

from __future__ import annotations

import json

from minisgl.bench import main


def test_bench_offline_runs_and_reports_throughput(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    main(["offline", "--model", str(tiny_model_dir("llama")), "--num-prompts", "4", "--input-len", "16",
          "--output-len", "4", "--repeat", "2", "--json", str(out)])
    assert "tok/s" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert len(res["minisgl_runs_s"]) == 2  # the best of the runs is reported
    assert abs(res["minisgl_seconds"] - min(res["minisgl_runs_s"])) < 0.01


def test_bench_agents_radix_beats_naive_on_cached_tokens(tiny_model_dir, tmp_path):
    import json

    out = tmp_path / "agents.json"
    main(["agents", "--model", str(tiny_model_dir("llama")), "-k", "3", "-t", "2", "--system-len", "64",
          "--tool-len", "8", "--output-len", "4", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["naive"]["cached_tokens"] == 0
    # Agents share the system prompt and their own history: radix serves most of it from the cache.
    assert res["radix"]["hit_ratio_of_max"] >= 0.9
    assert res["radix"]["prefill_tokens_computed"] < res["naive"]["prefill_tokens_computed"]
