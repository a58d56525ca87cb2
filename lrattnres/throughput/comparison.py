"""What of Appendix I's measurement protocol a throughput result follows, and what differs: one row
per aspect, the paper's setting beside the result's, computed from the result itself (so that a
result recorded before this existed is described by the same rules)."""

from __future__ import annotations

from typing import Any

from lrattnres.throughput.spec import METHOD_TABLE, PAPER_SIZES
from lrattnres.throughput.summary import paper_gpu

PAPER = {
    "gpu": "H100 and B200",
    "software": "PyTorch 2.10.0 (CUDA 13.0), Triton 3.6.0, FlashAttention 2.8.3",
    "precision": "bf16",
    "compile": "torch.compile fullgraph=True, dynamic=False, no CUDA graphs",
    "batch": "micro-batch 2 x 2048, 64 accumulation steps (262,144 tokens per update)",
    "attention": "FlashAttention 2.8.3 with document masking",
    "tokens": "cached real training tokens with production document boundaries",
    "methods": "FLA r = d, Fast-AttnRes r = d and r = d/4, N = 8",
    "weights": "matched shared backbone initialisation and seed across methods",
    "timed": "host-to-device transfer, forward, backward, accumulation, clipping, optimiser update; compilation, "
             "storage reads, evaluation and logging excluded",
    "updates": "3 warm-up updates, then 8 to 30 measured; stop when two consecutive six-update windows each have "
               "CV <= 1% and drift <= 0.5%; every measured update counts",
    "repeats": "five fresh repeats per configuration, method order rotated",
    "interval": "paired gains, mean +- t(0.975, 4) s_g / 5",
}


def _row(aspect: str, here: str, same: bool | None, note: str = "") -> dict[str, Any]:
    return {"aspect": aspect, "paper": PAPER[aspect], "here": here, "same": same, "note": note}


def compare(res: dict) -> list[dict[str, Any]]:
    """Rows ``{aspect, paper, here, same, note}``; ``same`` is None where the result does not say."""
    s = res.get("spec") or {}
    prov = res.get("provenance") or {}
    rows = res.get("rows") or []
    runs = res.get("runs") or []
    out = []
    dev = str(res.get("device") or prov.get("device") or "?")
    out.append(_row("gpu", dev, paper_gpu(dev) is not None))
    ver = prov.get("versions") or {}
    here = ", ".join(f"{k} {ver[k]}" for k in ("torch", "triton") if k in ver) or "not recorded"
    out.append(_row("software", here, None if not ver else (str(ver.get("torch", "")).startswith("2.10")
                                                               and str(ver.get("triton", "")).startswith("3.6"))))
    out.append(_row("precision", str(res.get("precision")), res.get("precision") == "bf16"))
    if res.get("compile"):
        firsts = [r.get("graphs_compiled") for r in runs if r.get("graphs_compiled")]
        one = bool(firsts) and all(g == 1 for g in firsts)
        out.append(_row("compile", "torch.compile dynamic=False of the loss module (the trainer's), no CUDA graphs; "
                                   + ("one graph per method (no graph breaks, as fullgraph=True asks)" if one else
                                      f"graphs per compilation: {sorted(set(firsts))}" if firsts else
                                      "graph count not recorded"),
                        one if firsts else None))
    else:
        out.append(_row("compile", "eager (not compiled)", False))
    accum = sorted({r.get("grad_accum") for r in rows if r.get("grad_accum") is not None}) or [s.get("grad_accum")]
    mb, sl = s.get("micro_batch"), s.get("seq_len")
    out.append(_row("batch", f"micro-batch {mb} x {sl}, accumulation {', '.join(map(str, accum))}",
                    mb == 2 and sl == 2048 and accum == [64]))
    att = prov.get("attention") or {}
    backend = att.get("backend") if isinstance(att, dict) else None
    out.append(_row("attention", f"{backend} ({att.get('version')})" if backend else f"{s.get('attention')} (resolved "
                    "backend not recorded)", backend == "flash" if backend else None))
    tok = str(res.get("tokens") or "")
    out.append(_row("tokens", tok or "not recorded", tok.startswith("data") if tok else None,
                    "" if tok.startswith("data") else "synthetic documents (log-normal lengths) over the preset's "
                    "vocabulary, cached once and transferred every update as real batches are"))
    names = sorted({r["name"] for r in rows}, key=list(METHOD_TABLE).index)
    ns = sorted({r.get("N") for r in rows if r.get("N") is not None})
    sizes = sorted({r["preset"] for r in rows})
    out.append(_row("methods", f"{', '.join(names) or 'none'} at {', '.join(sizes) or '?'}, N = "
                               f"{', '.join(map(str, ns)) or '?'}",
                    False, "this project's kernel (kernels.attnres) in place of Fast-AttnRes"
                    + ("" if "fla-rd" in names else "; FLA not timed (see the skipped list)")
                    + ("" if set(sizes) <= set(PAPER_SIZES) else "; not the paper's sizes")))
    out.append(_row("weights", "one seeded backbone initialisation per repeat, loaded into every method's model, "
                               "routing queries zero", True))
    out.append(_row("timed", "the trainer's update between device synchronisations: transfer, forward, backward, "
                             "accumulation, clipping, Muon + AdamW, zero_grad; compilation in the warm-up", True))
    up = (f"{s.get('warmup')} warm-up, {s.get('min_updates')} to {s.get('max_updates')} measured; windows of "
          f"{s.get('window')} updates {s.get('stride')} apart, CV <= {s.get('cv')}, drift <= {s.get('drift')}")
    same_up = (s.get("warmup"), s.get("min_updates"), s.get("max_updates"), s.get("window"), s.get("cv"),
               s.get("drift")) == (3, 8, 30, 6, 0.01, 0.005)
    out.append(_row("updates", up, same_up, "consecutive windows read as the last six updates and the six ending "
                                            f"{s.get('stride')} earlier" if same_up else ""))
    base = s.get("repeats")
    extra = [r for r in runs if base is not None and r.get("repeat", 0) >= base]
    procs = {r.get("process") for r in runs if r.get("process")}
    shared_graph = bool(res.get("compile")) and any(r.get("graphs_compiled") == 0 for r in runs)
    here = f"{base} repeats, method order rotated"
    if extra:
        here += (f", then {len({(r['preset'], r['repeat']) for r in extra})} more of "
                 f"{' and '.join(sorted({r['name'] for r in extra}))} to resolve the {s.get('resolve_gain')} gain")
    if res.get("compile"):
        here += (f"; in {len(procs)} process{'es' if len(procs) != 1 else ''}, the repeats of a method in one "
                 "process share its compiled graph (weights reloaded, optimiser state new)" if procs else
                 "; every timed run compiles afresh")
    out.append(_row("repeats", here, base == 5 and not shared_graph,
                    "repeats sharing a compiled graph are not fresh processes" if shared_graph else ""))
    out.append(_row("interval", "paired gains, mean +- t(0.975, n-1) s_g / sqrt(n)", False,
                    "the paper's s_g / 5 reads as a typo for the standard error s_g / sqrt(5)"))
    return out


def differences(res: dict) -> list[str]:
    """One line per aspect that differs from the paper's protocol (for notes and labels)."""
    return [f"{r['aspect']}: {r['here']} (paper: {r['paper']})" for r in compare(res) if r["same"] is False]
