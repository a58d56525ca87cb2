"""The fused kernel: correctness against the reference (Appendix I, Table 10) and, when a GPU benchmark
was recorded, its timings against the published kernels and the memory roofline."""

from __future__ import annotations

from lrattnres.report.html import claims_table, esc, fmt, table

TITLE = "Fused kernel: correctness and speed (Appendix I, Table 10)"
ORDER = 80


def _table10(ctx) -> str:
    rows: dict[tuple, dict] = {}
    for rec in ctx.published.values():
        if rec["source"] == "Table 10":
            row = rec["row"]
            rows.setdefault((row.get("size"), row.get("impl"), row.get("r")), {})[row.get("output")] = rec["published"]
    body = [[k[0], k[1], k[2], v.get("forward"), v.get("source_grad"), v.get("query_grad")] for k, v in rows.items()]
    return table(["size", "impl", "r", "forward", "source grad.", "query grad."], body,
                 "Table 10 (published): max relative L2 errors (%) against PyTorch on trained checkpoints, H100")


def build(ctx) -> str:
    parts = []
    checks = ctx.results("kernel")
    if checks:
        res = checks[0]
        ex = res["four_number_example"]
        parts.append(f"<p>Four-number example of the explainer: largest deviation {esc(fmt(ex['reference_err']))} (reference), "
                     f"{esc(fmt(ex['kernels_attnres_err']))} (<code>kernels.attnres</code>, {esc(res['device'])}).</p>")
        if res["cases"]:
            parts.append(table(
                ["d", "r", "S", "tokens", "norm", "dtype", "criterion max (≤ 1 passes)", "rel. L2 out", "rel. L2 source grad.", "rel. L2 query grad."],
                [[c["d"], c["r"], c["S"], c["tokens"], c["norm"], c["dtype"], c["criterion_max"], c["rel_out"], c["rel_src_grad"], c["rel_query_grad"]] for c in res["cases"]],
                f"This run: the fused kernels against the reference on fresh random inputs ({res['device']})"))
        else:
            parts.append(f'<p class="notrun">{esc(res.get("note", "no kernel cases ran"))}</p>')
    else:
        parts.append('<p class="notrun">The kernel check has not run at this scale yet.</p>')
    parts.append(_table10(ctx))

    bench = ctx.recorded.get("kernel")
    if bench:
        env = bench.get("env", {})
        flag = " (partial run: timings incomplete)" if bench.get("truncated") else ""
        parts.append(f"<h3>Recorded GPU benchmark{esc(flag)}</h3><p class='note'>{esc(env.get('device'))}, torch {esc(env.get('torch'))}, "
                     f"triton {esc(env.get('triton'))}, {esc(env.get('date'))}; measured copy bandwidth {esc(fmt(bench.get('copy_bw_TBps')))} TB/s; "
                     f"file <code>{esc(bench.get('_path'))}</code>. % = roofline bytes / (time × copy bandwidth): forward (S+1)·N·d·2, "
                     "forward+backward (3S+2)·N·d·2 bytes.</p>")
        if bench.get("check"):
            parts.append(table(["d", "r", "S", "norm", "tokens", "pass", "out rel L2", "src grad rel L2", "query grad rel L2"],
                               [[c["d"], c["r"], c["S"], c["norm"], c["tokens"], c["pass"], c["out_rel_l2"], c["src_grad_rel_l2"], c["query_grad_rel_l2"]] for c in bench["check"]],
                               "bf16 check on the GPU (|x − ref| ≤ 0.05 + 0.05|ref|)"))
        rows = bench.get("rows", [])
        if rows:
            cold = any(r.get("fwdbwd_graph_cold_us") is not None for r in rows)  # older recordings lack them
            extra = ["cold graph fwd µs", "cold graph fwd+bwd µs", "cold graph fwd+bwd %"] if cold else []
            parts.append(table(["tokens", "d", "S", "r", "impl", "fwd µs", "fwd %", "fwd+bwd µs", "fwd+bwd %",
                                "graph fwd µs", "graph fwd %", "graph fwd+bwd µs", "graph fwd+bwd %"] + extra,
                               [[r["tokens"], r["d"], r["S"], r["r"],
                                 r["impl"] + (f" (from {r['from_run']})" if r.get("from_run") else ""),
                                 r.get("fwd_us"), r.get("fwd_pct"),
                                 r.get("fwdbwd_us"), r.get("fwdbwd_pct"), r.get("fwd_graph_us"), r.get("fwd_graph_pct"),
                                 r.get("fwdbwd_graph_us"), r.get("fwdbwd_graph_pct")]
                                + ([r.get("fwd_graph_cold_us"), r.get("fwdbwd_graph_cold_us"), r.get("fwdbwd_graph_cold_pct")]
                                   if cold else []) for r in rows],
                               "Timings: called eagerly (median of triton do_bench, L2 flushed; host-side dispatch "
                               "counts where it outlasts the flush) and as CUDA-graph replays (GPU time alone)"
                               + ("; cold: replays with the L2 flushed before each (every input from DRAM)" if cold else "")))
            timed = [r for r in rows if r.get("kernels_fwdbwd_us")]  # older recordings lack them
            if timed:
                parts.append(table(["tokens", "d", "S", "r", "impl", "sum µs", "kernels (µs each)"],
                                   [[r["tokens"], r["d"], r["S"], r["r"], r["impl"], sum(r["kernels_fwdbwd_us"].values()),
                                     "; ".join(f"{k} {v:.1f}" for k, v in r["kernels_fwdbwd_us"].items())] for r in timed],
                                   "Where the time goes: GPU time of each kernel in one forward+backward (torch.profiler, "
                                   "eager call; launch gaps not counted)"))
    else:
        parts.append('<p class="notrun">No GPU kernel benchmark is recorded (<code>reports/recorded.yaml</code>, key <code>kernel</code>).</p>')
    parts.append(claims_table([c for c in ctx.claims.values() if ctx.published[c["id"]]["stage"] == "kernel"], "Kernel claims"))
    return "\n".join(parts)
