"""The table `minisgl bench tp all` prints last (its stages: minisgl.bench.tp_stages)."""

from typing import Any


def _print_parity(r: dict[str, Any]) -> None:
    p = r.get("parity", {})
    if "tp2_vs_tp1_teacher_forced" in p:
        tf, h2, h1 = p["tp2_vs_tp1_teacher_forced"], p["tp2_vs_hf_fp32"], p["tp1_vs_hf_fp32"]
        print(
            f"parity ({p['prompts']} prompts x {p['new_tokens']} greedy tokens, {p['dtype']}, {tf['positions']} "
            f"positions; "
            f"clear = fp32 HF top-2 margin > 1%, {tf['clear_positions']:.1%} of positions)"
        )
        print(
            f"  TP=2 tokens vs TP=1 teacher-forced top-1: {tf['top1']:.2%} all, {tf['top1_clear_margin']:.2%} clear "
            f"-> {'PASS' if p['pass'] else 'FAIL'} (>= 99%)"
        )
        print(
            f"  vs HF fp32 top-1: TP=2 {h2['top1']:.2%} / {h2['top1_clear_margin']:.2%} clear; "
            f"TP=1 {h1['top1']:.2%} / {h1['top1_clear_margin']:.2%} clear"
        )
        print(
            f"  greedy sequences identical TP=1 vs TP=2: {p['greedy_identical_tp1_tp2']}; "
            f"first divergences at {p['first_divergence_positions']}"
        )
    elif p:
        print(f"parity: {p}")
    n = r.get("nodes")
    if n:
        print(
            f"two nodes (nnodes 2, 1 GPU each, tcp 127.0.0.1) vs TP=2 one node: identical {n.get('identical_outputs')} "
            f"-> {'PASS' if n.get('pass') else 'FAIL'} (exits node0={n['node0_exit']} node1={n['node1_exit']})"
        )


def print_table(r: dict[str, Any]) -> None:
    print(f"\n## {r.get('gpu')}, {r.get('date')}")
    _print_parity(r)
    t = r.get("tput")
    if t:
        print(f"throughput, {t['model']}, {t['requests']} requests (the offline workload)")
        for key in [k for k in t if k.startswith("tp")]:
            x = t[key]
            name = key.replace("tp", "TP=", 1)
            if "output_tok_s" in x:
                lat = f", bs1 {x['decode_ms_per_token_bs1']} ms/token" if "decode_ms_per_token_bs1" in x else ""
                speedup = f" = {x['speedup']}x TP=1" if "speedup" in x else ""
                runs = x.get("output_tok_s_runs", [])
                spread = f" (median of {len(runs)}: {min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""
                print(
                    f"  {name}: {x['output_tok_s']:.1f} output tok/s{spread}{speedup}, {x['seconds']:.2f}s, "
                    f"{x['kv_pages']} KV slots, init {x['init_s']}s{lat}"
                )
            else:
                print(f"  {name}: {x}")
            for rank, y in x.get("profile", {}).items():
                print(
                    f"    {rank} profile: {y['steps']} steps, wall {y['wall_ms_per_step']} ms/step, host "
                    f"{y['host_ms_per_step']}, ops wait {y['ops_wait_ms_per_step']}, device wait "
                    f"{y['device_wait_ms_per_step']}; GPU {y['gpu_total_ms_per_step']} ms/step {y['gpu_ms_per_step']}"
                )
        if "speedup" in t:
            print(f"  TP=2 / TP=1 = {t['speedup']}x -> {'PASS' if t['pass'] else 'FAIL'} (>= 1.6x)")
    for h in r.get("hfpatch", []):
        if "speedup" in h:
            print(
                f"HF generate drop-in, {h['num_prompts']} {h.get('prompt_set', 'random')} prompts, "
                f"{h['output_len']} new tokens: HF {h['hf_output_tok_s']} tok/s, patched "
                f"{h['minisgl_output_tok_s']} tok/s = {h['speedup']}x ({'PASS' if h['pass'] else 'FAIL'} >= 10x); "
                f"identical rows {h['identical_rows']}"
            )
        else:
            print(f"hfpatch: {h}")
    for key in [k for k in r if k.startswith("kill")]:
        k = r[key]
        print(
            f"{key}: rank 1 SIGKILLed mid-stream (serve --tp 2): stream error after "
            f"{k.get('seconds_to_stream_error')}s "
            f"({k.get('stream_error')}); daemon exit {k.get('daemon_exit')} after {k.get('seconds_to_daemon_exit')}s; "
            f"left behind {k.get('left_behind')} -> {'PASS' if k.get('pass') else 'FAIL'}"
        )
    for budget, a in r.get("agents", {}).items():
        if "ttft_p50_ratio_naive_over_radix" in a:
            ra, na = a["radix"], a["naive"]
            print(
                f"agents K=64 T=6, max_prefill_tokens {budget}: TTFT p50 radix {ra['ttft_p50_ms']} ms vs naive "
                f"{na['ttft_p50_ms']} ms = {a['ttft_p50_ratio_naive_over_radix']}x; hit ratio of max "
                f"{ra['hit_ratio_of_max']:.1%}; end to end {ra['seconds']}s vs {na['seconds']}s -> "
                f"{'PASS' if a['pass'] else 'FAIL'}"
            )
        else:
            print(f"agents ({budget}): {a}")
