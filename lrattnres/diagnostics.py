"""Routing diagnostics (Sections 4.6-4.7, Appendices C.4, C.5, D.1, E.2, G.1; Figures 4, 6-8, 10 right;
Tables 6 and 9).

``python -m lrattnres diagnostics --settings S.json --runs RUNS --data manifest.json --run ID
--out diagnostics/ID.json`` analyses one run (its model is needed, so a GPU machine runs it right after
training); ``python -m lrattnres diagnostics --settings S.json --published reports/published.yaml
--aggregate diagnostics/*.json --out diagnostics.json`` makes the figures and claims from the rows
(no model, no torch).

For every run of :func:`lrattnres.gridplan.plan` (run folder ``RUNS/<run_id>``):

* **Effective number of sources** per read site (Eq. 14): ``N_eff(t, x) = exp(H(alpha_t(x)))`` with
  ``H = -sum_i alpha_{t,i} log alpha_{t,i}`` over the sources of read t, averaged over the held-out
  tokens (the validation split, first ``tokens`` targets in order; the paper uses 1,007,616 tokens).
  ``n_eff[t-1]`` belongs to read t (after write t, t = 1..2L); the last entry is the final read, the
  one that feeds the head.  The embedding-only read before the first sub-layer has one source and no
  query; it is not listed.
* **Mean depth-wise attention** (Figure 8): ``heatmap[t-1][j]`` is the token-averaged weight that read t
  gives source j.  Source indexing: column 0 is the embedding o_0; column j >= 1 is block j, i.e. the
  sum of the writes ``block_ends[j-2]+1 .. block_ends[j-1]``.  A read inside block j sees that block as
  its current partial sum, in the same column j it will occupy once complete.  With full routing block
  j is write o_j.  Columns a read cannot see (later blocks) are ``null``; every row sums to 1.
* **Gradient norms** (Table 9, Figure 7, Figure 10 right): mean, population variance and the share of
  steps (in %) whose pre-clipping norm exceeds the clip threshold (the run's ``grad_clip``; 1 when it
  has none, the threshold of Table 9), from the ``train`` records of ``metrics.jsonl``; traces with a
  trailing mean over ``trailing_window`` steps.
* **Static-query utilisation** (Appendix E.2, Table 6): per query q_t (row t-1 of ``queries``; our
  routing RMSNorms are weightless, so the folded query of E.1 is q_t itself), the coordinate
  effective dimension ``D_eff = exp(-sum_j p_j log p_j)`` with ``p_j = q_j^2 / sum_k q_k^2``, and the
  fraction of exactly zero coordinates (no tolerance).  A query that is zero everywhere has no
  distribution; it counts in the zero fraction but not in D_eff (``n_zero_queries``).  Groups as in
  Table 6: ``pre_attention`` (reads after even writes t < 2L: they feed an attention sub-layer; the
  embedding-only first read has no query), ``pre_mlp`` (reads after odd writes), ``final_output``.

The scale's settings may carry a ``diagnostics`` block (:data:`DEFAULTS` lists its keys).  Claims
(``reports/published.yaml``, stage ``diagnostics``) map runs to the paper's rows as
:mod:`lrattnres.grid` does: :func:`lrattnres.gridplan.paper_row` (same method and N, same r/d), the roles of
Section 4.4 (headline, control) for the N = 8 rows, and the size pair (roles ``pair-small`` /
``pair-large``) for 1B / 4B.  Direction claims say in their note which runs stood in.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from lrattnres.checks import is_int, is_number
from lrattnres.devices import resolve_device
from lrattnres.errors import UserError
from lrattnres.gridplan import CONTROL, HEADLINE_ATTNRES, HEADLINE_LR, PAIR_SIZES, PAPER_D, paper_row, plan
from lrattnres.io import atomic_write_json, read_json
from lrattnres.presets import get_preset
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.diagnostics")

# The scale's ``diagnostics`` block: every key and its default.
DEFAULTS: dict[str, Any] = {
    "tokens": 65536,  # held-out tokens for N_eff and heatmaps (the paper: 1,007,616 = 492 x 2048)
    "batch_size": 8,  # sequences per forward pass
    "seq_len": None,  # window length; None: the run's training seq_len
    "split": "val",  # the held-out split of the manifest
    "device": "auto",  # auto | cpu | cuda
    "trailing_window": 50,  # steps of the trailing mean of Figure 10 (the paper: 1,000)
    "trace_points": 2000,  # at most this many points of each gradient-norm trace kept for Figure 10
}
DEVICES = ("auto", "cpu", "cuda")
QUERY_GROUPS = ("pre_attention", "pre_mlp", "final_output", "all")


class DiagnosticsError(UserError, ValueError):
    """Bad settings or inputs; the message names the file or key and what was expected."""


# ------------------------------------------------------------------------------------ settings


def validate_settings(block: Any, where: str = "diagnostics") -> dict[str, Any]:
    """The scale's ``diagnostics`` block with defaults filled in; bad keys are named."""
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise DiagnosticsError(f"{where}: expected a mapping with keys {sorted(DEFAULTS)}, got {type(block).__name__}")
    unknown = sorted(set(block) - set(DEFAULTS))
    if unknown:
        raise DiagnosticsError(f"{where}: unknown key(s) {unknown}; expected only {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **block}

    def bad(key: str, expected: str) -> None:
        raise DiagnosticsError(f"{where}.{key}: expected {expected}, got {out[key]!r}")

    for key in ("tokens", "batch_size", "trailing_window", "trace_points"):
        if not is_int(out[key]) or out[key] < 1:
            bad(key, "an integer >= 1")
    if out["seq_len"] is not None and (not is_int(out["seq_len"]) or out["seq_len"] < 1):
        bad("seq_len", "null (the run's training seq_len) or an integer >= 1")
    if not isinstance(out["split"], str) or not out["split"]:
        bad("split", "a split name of the data manifest (e.g. 'val')")
    if out["device"] not in DEVICES:
        bad("device", f"one of {list(DEVICES)}")
    return out


# ------------------------------------------------------------------------ N_eff and heatmaps


def effective_sources(weights):
    """Per-token N_eff = exp(entropy) of routing weights [..., S] (0 log 0 = 0), in float64."""
    import torch

    w = weights.double()
    plogp = torch.where(w > 0, w * torch.log(w.clamp_min(1e-300)), torch.zeros_like(w))
    return torch.exp(-plogp.sum(-1))


def source_columns(n_writes: int, blocks) -> list[str]:
    """Labels of the heatmap columns: ``emb`` then one per block (``o1`` ... for full routing)."""
    from lrattnres.routing import block_ends

    ends = block_ends(n_writes, blocks)
    if blocks in ("full", None):
        return ["emb"] + [f"o{t}" for t in ends]
    labels, start = ["emb"], 1
    for e in ends:
        labels.append(f"B{len(labels)} (o{start}-o{e})" if e > start else f"B{len(labels)} (o{e})")
        start = e + 1
    return labels


def sources_per_read(n_writes: int, blocks) -> list[int]:
    """S_t for reads t = 1..2L: embedding + completed blocks + the partial block if nonempty."""
    from lrattnres.routing import block_ends

    ends = set(block_ends(n_writes, blocks))
    out, done, partial = [], 0, False
    for t in range(1, n_writes + 1):
        if t in ends:
            done, partial = done + 1, False
        else:
            partial = True
        out.append(1 + done + int(partial))
    return out


class RoutingAccumulator:
    """Token sums of N_eff and of the routing weights, per read; fed the model's routing lists."""

    def __init__(self):
        self.tokens = 0
        self.n_eff_sum: list[float] | None = None
        self.weight_sum: list | None = None

    def update(self, routing: list, mask=None) -> None:
        """``routing``: the model's list over reads of weights [B, T, S_t]; ``mask`` [B, T] bool keeps
        the tokens that count (default: all)."""
        import torch

        if not routing:
            raise DiagnosticsError("routing is empty: the baseline has no depth routing")
        if self.n_eff_sum is None:
            self.n_eff_sum = [0.0] * len(routing)
            self.weight_sum = [torch.zeros(w.shape[-1], dtype=torch.float64) for w in routing]
        if len(routing) != len(self.n_eff_sum):
            raise DiagnosticsError(f"routing has {len(routing)} reads, earlier batches had {len(self.n_eff_sum)}")
        n = None
        for t, w in enumerate(routing):
            w = w.detach()
            if mask is not None:
                w = w[mask.to(w.device)]
            w = w.reshape(-1, w.shape[-1]).double()
            n = w.shape[0]
            self.n_eff_sum[t] += float(effective_sources(w).sum())
            self.weight_sum[t] += w.sum(0).cpu()
        self.tokens += n or 0

    def result(self) -> dict[str, Any]:
        if not self.tokens:
            raise DiagnosticsError("no tokens were routed (empty held-out split?)")
        width = max(len(w) for w in self.weight_sum)
        heat = []
        for w in self.weight_sum:
            row = (w / self.tokens).tolist()
            heat.append(row + [None] * (width - len(row)))
        return {
            "n_eff": [s / self.tokens for s in self.n_eff_sum],
            "heatmap": heat,
            "tokens": self.tokens,
            "sources": [len(w) for w in self.weight_sum],
        }


def routing_diagnostics(model, batches, device, tokens: int, autocast_dtype=None) -> dict[str, Any]:
    """N_eff per read and the mean heatmap over the first ``tokens`` tokens of ``batches``."""
    import torch

    acc = RoutingAccumulator()
    left = tokens
    model.eval()
    with torch.no_grad():
        for batch in batches:
            if left <= 0:
                break
            B, T = batch.inputs.shape
            mask = None
            if B * T > left:  # keep the first `left` tokens in reading order
                mask = (torch.arange(B * T) < left).view(B, T)
                rows = int(mask.any(1).sum())
                batch, mask = batch.head(rows), mask[:rows]
            b = batch.to(device)
            if autocast_dtype is not None:
                with torch.autocast(device.type, dtype=autocast_dtype):
                    _, routing = model(b.inputs, b.doc_ids, return_routing=True, segments=b.segments)
            else:
                _, routing = model(b.inputs, b.doc_ids, return_routing=True, segments=b.segments)
            acc.update(routing, mask)
            left = tokens - acc.tokens
    return acc.result()


# ------------------------------------------------------------------------------ gradient norms


def read_grad_norms(metrics_path: str | Path) -> list[tuple[int, float]]:
    """(step, pre-clip gradient norm) of every training record of a run's ``metrics.jsonl``.

    Training records have ``"kind": "train"`` (older logs: ``"step"`` or no kind); validation records
    are skipped.  A line cut short by a kill (the last one) is ignored; a bad line elsewhere is an
    error naming the file and line."""
    path = Path(metrics_path)
    if not path.exists():
        raise DiagnosticsError(f"{path}: metrics file not found")
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                log.warning("%s: last line is cut short; ignored", path)
                continue
            raise DiagnosticsError(f"{path}: line {i + 1} is not JSON ({e})") from None
        if rec.get("kind", "train") not in ("train", "step") or "grad_norm" not in rec:
            continue
        g = rec["grad_norm"]
        g = float(g) if isinstance(g, (int, float, str)) else float("nan")  # "nan"/"inf" are strings
        out.append((int(rec.get("step", len(out) + 1)), g))
    return out


def grad_norm_stats(norms: list[float], clip: float | None = 1.0) -> dict[str, Any]:
    """Mean, population variance and the percentage of steps above ``clip`` (Table 9)."""
    vals = [x for x in norms if math.isfinite(x)]
    n = len(vals)
    if not n:
        return {"mean": None, "var": None, "above_clip_pct": None, "count": 0, "clip": clip, "non_finite": len(norms)}
    mean = math.fsum(vals) / n
    var = math.fsum((x - mean) ** 2 for x in vals) / n
    above = None if clip is None else 100.0 * sum(x > clip for x in vals) / n
    return {"mean": mean, "var": var, "above_clip_pct": above, "count": n, "clip": clip,
            "non_finite": len(norms) - n}


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    out, s = [], 0.0
    for i, v in enumerate(values):
        s += v
        if i >= window:
            s -= values[i - window]
        out.append(s / min(i + 1, window))
    return out


def _thin(n: int, points: int) -> list[int]:
    if n <= points:
        return list(range(n))
    idx = sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})
    return idx


# -------------------------------------------------------------------------- query utilisation


def coordinate_effective_dim(q) -> float | None:
    """D_eff = exp(Shannon entropy of p_j = q_j^2 / sum_k q_k^2) (Appendix E.2); None for q = 0."""
    import torch

    q = torch.as_tensor(q).detach().double().flatten()
    s = (q * q).sum()
    if not s > 0:
        return None
    p = q * q / s
    h = -torch.where(p > 0, p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p)).sum()
    return float(torch.exp(h))


def zero_fraction(q) -> float:
    """Fraction of coordinates exactly equal to zero (no tolerance)."""
    import torch

    q = torch.as_tensor(q).detach().flatten()
    return float((q == 0).sum()) / q.numel()


def query_group(t: int, n_writes: int) -> str:
    """Table 6's site type of query t (serving the read after write t, 1-based)."""
    if t == n_writes:
        return "final_output"
    return "pre_mlp" if t % 2 == 1 else "pre_attention"


def query_utilisation(queries) -> dict[str, Any]:
    """Per-query D_eff and zero fraction of a [2L, r] query matrix, summarised per group."""
    n_writes, width = queries.shape
    per = []
    for t in range(1, n_writes + 1):
        q = queries[t - 1]
        per.append({"read": t, "group": query_group(t, n_writes), "d_eff": coordinate_effective_dim(q),
                    "zero_frac": zero_fraction(q)})

    def summary(rows: list[dict]) -> dict[str, Any]:
        d = [r["d_eff"] for r in rows if r["d_eff"] is not None]
        return {
            "count": len(rows),
            "d_eff_mean": statistics.fmean(d) if d else None,
            "d_eff_median": statistics.median(d) if d else None,
            "zero_frac": statistics.fmean(r["zero_frac"] for r in rows) if rows else None,
            "n_zero_queries": len(rows) - len(d),
        }

    groups = {g: summary([r for r in per if g == "all" or r["group"] == g]) for g in QUERY_GROUPS}
    out = dict(groups["all"])
    out.update(width=width, d_eff_frac=None if out["d_eff_mean"] is None else out["d_eff_mean"] / width,
               groups=groups, per_query=per)
    return out


# ----------------------------------------------------------------------------------- one run


def _device(name: str):
    """The device of the ``device`` setting."""
    return resolve_device(name, where="diagnostics.device", error=DiagnosticsError)


def _clip_of(folder: Path, info: dict | None, settings: dict) -> float:
    """The run's grad_clip (spec.json, else the weights' spec, else the scale's recipe); 1 if none."""
    spec = None
    if (folder / "spec.json").exists():
        spec = read_json(folder / "spec.json").get("spec")
    if spec is None and info:
        spec = info.get("spec")
    if spec is None:
        spec = {**settings.get("recipe", {}), **settings.get("train", {})}
    clip = spec.get("grad_clip", 1.0)
    return float(clip) if is_number(clip) else 1.0


def analyse_run(run, folder: Path, manifest: dict | None, settings: dict, diag: dict, device) -> dict[str, Any]:
    """Every diagnostic of one run folder (see the module doc)."""
    import torch

    from lrattnres.train.checkpoint import MODEL_FILE, load_model

    shape = get_preset(run.preset)
    row: dict[str, Any] = {
        "run_id": run.run_id, "preset": run.preset, "d_model": shape["d_model"], "n_layers": shape["n_layers"],
        "method": run.method, "blocks": run.blocks, "rank": run.rank, "seed": run.seed, "roles": list(run.roles),
    }
    row["paper_row"] = paper_row(row, shape["d_model"])
    row["r_over_d"] = None if run.rank is None else run.rank / shape["d_model"]

    row.update(n_eff=None, heatmap=None, query_util=None, tokens=0)
    info = None
    if run.method != "baseline":
        weights = folder / MODEL_FILE
        model, info = load_model(weights, device)
        cfg = model.cfg
        if (cfg.method, cfg.blocks, cfg.rank) != (run.method, run.blocks, run.rank):
            raise DiagnosticsError(
                f"{weights}: holds method={cfg.method} blocks={cfg.blocks} rank={cfg.rank}, but the grid "
                f"plans {run.run_id} as method={run.method} blocks={run.blocks} rank={run.rank}")
        if manifest is not None:
            if int(manifest["vocab_size"]) > cfg.vocab_size:
                raise DiagnosticsError(f"{manifest.get('_path')}: vocab_size {manifest['vocab_size']} exceeds the model's "
                                       f"{cfg.vocab_size} ({weights}); not the data it was trained on")
            if info.get("manifest_sha256") and info["manifest_sha256"] != manifest.get("_sha256"):
                log.warning("%s: trained on manifest sha256 %s..., diagnosing on %s...", run.run_id,
                            str(info["manifest_sha256"])[:12], str(manifest.get("_sha256"))[:12])
            from lrattnres.data import iter_eval_batches

            seq_len = diag["seq_len"] or (info.get("spec") or {}).get("seq_len") or cfg.max_seq_len
            if seq_len > cfg.max_seq_len:
                raise DiagnosticsError(f"diagnostics.seq_len={seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
            windows = -(-diag["tokens"] // seq_len)
            batches = iter_eval_batches(manifest, diag["split"], diag["batch_size"], seq_len,
                                        max_batches=-(-windows // diag["batch_size"]), verify=False)
            if batches.tokens_covered < diag["tokens"]:
                log.warning("%s: split %r holds %d windows of %d tokens, fewer than the %d tokens asked for",
                            run.run_id, diag["split"], batches.n_windows, seq_len, diag["tokens"])
            precision = (info.get("spec") or {}).get("precision", "fp32")
            amp = torch.bfloat16 if (precision == "bf16" and device.type == "cuda") else None
            stats = routing_diagnostics(model, batches, device, diag["tokens"], amp)
            from lrattnres.attention import describe as describe_attention

            row["attention"] = describe_attention(cfg.attention, device)
            row.update(n_eff=stats["n_eff"], heatmap=stats["heatmap"], tokens=stats["tokens"],
                       sources=stats["sources"], seq_len=seq_len,
                       source_columns=source_columns(2 * cfg.n_layers, cfg.blocks))
        row["query_util"] = query_utilisation(model.queries.detach().float().cpu())
        del model

    norms = read_grad_norms(folder / "metrics.jsonl")
    clip = _clip_of(folder, info, settings)
    values = [g for _, g in norms]
    row["grad_norm"] = grad_norm_stats(values, clip)
    finite = [g if math.isfinite(g) else float("nan") for g in values]
    keep = _thin(len(finite), diag["trace_points"])
    trail = trailing_mean([g if math.isfinite(g) else 0.0 for g in finite], diag["trailing_window"])
    row["grad_norm_trace"] = {
        "step": [norms[i][0] for i in keep],
        "norm": [finite[i] if math.isfinite(finite[i]) else None for i in keep],
        "trailing_mean": [trail[i] for i in keep],
        "window": diag["trailing_window"],
    }
    return row


# -------------------------------------------------------------------------------- figures data


def _main_seed0(rows: list[dict], settings: dict) -> list[dict]:
    main = settings["presets"]["main"]
    return [r for r in rows if r["preset"] == main and r["seed"] == 0]


def n8_blocks(rows: list[dict], settings: dict):
    """The N that stands for the paper's N = 8: 8 when the main preset has an AttnRes run at N = 8,
    else the headline's N (the paper's headline is N = 8)."""
    seed0 = _main_seed0(rows, settings)
    if any(r["method"] == "attnres" and r["blocks"] == 8 for r in seed0):
        return 8
    h = settings["grid"].get("headline")
    return h["blocks"] if h else None


def _closest(runs: list[dict], target_ratio: float) -> dict | None:
    runs = [r for r in runs if r.get("rank")]
    if not runs:
        return None
    return min(runs, key=lambda r: (abs(math.log(r["r_over_d"] / target_ratio)), r["rank"]))


def fig6_runs(rows: list[dict], settings: dict) -> dict[str, dict | None]:
    """AttnRes, projected and sliced runs at the N = 8 analogue (the paper: r = 32 projected, r = 64
    sliced; otherwise the run of that method whose r/d is closest to the paper's)."""
    N = n8_blocks(rows, settings)
    seed0 = [r for r in _main_seed0(rows, settings) if r["blocks"] == N]
    at = next((r for r in seed0 if r["method"] == "attnres"), None)
    plr = [r for r in seed0 if r["method"] == "plr"]
    lr = [r for r in seed0 if r["method"] == "lr" and r["rank"] < r["d_model"]]
    return {
        "attnres": at,
        "plr": next((r for r in plr if r["paper_row"] == f"plr.n{N}.r32"), None) or _closest(plr, 32 / PAPER_D),
        "lr": next((r for r in lr if r["paper_row"] == f"lr.n{N}.r64"), None) or _closest(lr, 64 / PAPER_D),
    }


def figures_data(rows: list[dict], settings: dict) -> dict[str, Any]:
    seed0 = _main_seed0(rows, settings)
    routed = [r for r in seed0 if r.get("n_eff")]
    full = sorted((r for r in routed if r["blocks"] == "full" and r["method"] in ("lr", "attnres")), key=lambda r: r["rank"])
    fig4 = [{"run_id": r["run_id"], "method": r["method"], "rank": r["rank"], "r_over_d": r["r_over_d"],
             "paper_r": round(r["r_over_d"] * PAPER_D), "n_eff": r["n_eff"]} for r in full]
    N = n8_blocks(rows, settings)
    f6 = fig6_runs(rows, settings)
    fig6 = {"blocks": N, "runs": {m: (None if r is None else {"run_id": r["run_id"], "rank": r["rank"], "n_eff": r["n_eff"]})
                                  for m, r in f6.items()}}
    # full routing: projected runs beside the sliced runs of the same ranks and full AttnRes (C.4's matched pairs)
    plr_full = [r for r in routed if r["method"] == "plr" and r["blocks"] == "full"]
    ranks = {r["rank"] for r in plr_full}
    matched = [r for r in full if r["method"] == "attnres" or r["rank"] in ranks] if plr_full else []
    fig6["full"] = [{"run_id": r["run_id"], "method": r["method"], "rank": r["rank"], "n_eff": r["n_eff"]}
                    for r in sorted(plr_full + matched, key=lambda r: (r["method"], r["rank"]))]
    # Figure 7: mean gradient norm against rank, one series per (method, N); the baseline as a level
    series: dict[str, list] = {}
    for r in seed0:
        if r["method"] == "baseline" or r["grad_norm"]["mean"] is None:
            continue
        if not ({"sweep", "projected", "control"} & set(r["roles"])):
            continue
        key = f"{'lr' if r['method'] == 'attnres' else r['method']}.n{r['blocks']}"  # AttnRes: the sliced r = d end
        series.setdefault(key, []).append({"run_id": r["run_id"], "rank": r["rank"], "r_over_d": r["r_over_d"],
                                           "paper_r": round(r["r_over_d"] * PAPER_D), "mean": r["grad_norm"]["mean"]})
    for pts in series.values():
        pts.sort(key=lambda p: p["rank"])
    base = next((r for r in seed0 if r["method"] == "baseline"), None)
    fig7 = {"baseline": None if base is None else base["grad_norm"]["mean"], "series": series}
    # Figure 8: full routing at three ranks (top row), AttnRes / projected / sliced at N = 8 (bottom)
    low = [r for r in full if r["method"] == "lr"] or full
    top = [low[0], low[len(low) // 2], low[-1]] if len(low) > 3 else low
    fig8 = {"top": list(dict.fromkeys(r["run_id"] for r in top)),
            "bottom": [r["run_id"] for r in (f6["attnres"], f6["plr"], f6["lr"]) if r is not None]}
    # Figure 10 right: the size pair's traces
    fig10: dict[str, dict] = {}
    for role, size in zip(("small", "large"), PAIR_SIZES):
        for r in rows:
            if f"pair-{role}" in r["roles"]:
                fig10.setdefault(size, {})[r["method"]] = {"run_id": r["run_id"], **r["grad_norm_trace"]}
    return {"fig4": fig4, "fig6": fig6, "fig7": fig7, "fig8": fig8, "fig10": fig10}


# -------------------------------------------------------------------------------------- claims


def run_rows(rows: list[dict], settings: dict) -> dict[str, dict]:
    """Paper row key -> run (main preset, seed 0): grid.paper_row first, then the Section 4.4 roles
    (headline LR and AttnRes, the control) for the paper's N = 8 rows."""
    out: dict[str, dict] = {}
    seed0 = _main_seed0(rows, settings)
    for r in seed0:
        if r["paper_row"] and r["paper_row"] not in out:
            out[r["paper_row"]] = r
    h = settings["grid"].get("headline")
    if h:
        for r in seed0:
            if "seeds" in r["roles"] and r["method"] == "attnres":
                out.setdefault(HEADLINE_ATTNRES, r)
            if "seeds" in r["roles"] and r["method"] == "lr":
                out.setdefault(HEADLINE_LR, r)
    for r in seed0:
        if "control" in r["roles"]:
            out.setdefault(CONTROL, r)
    return out


SEGMENTS = 5  # contiguous segments of a run pair's per-step gradient norms (paired batch means)


def _norms_by_step(row: dict) -> dict:
    tr = row.get("grad_norm_trace") or {}
    return {st: g for st, g in zip(tr.get("step") or [], tr.get("norm") or [])
            if isinstance(g, (int, float)) and math.isfinite(g)}


def _segment_effects(rows: list[dict], effect, k: int = SEGMENTS) -> list[float]:
    """``effect(*segments)`` on ``k`` contiguous segments of the runs' per-step norms at the steps all
    of them logged (the runs share seed and data order, so a segment covers the same batches in
    each); [] with fewer than ``k`` common steps or where ``effect`` is undefined."""
    from lrattnres import stats

    by = [_norms_by_step(r) for r in rows]
    steps = sorted(set.intersection(*(set(b) for b in by))) if by else []
    if len(steps) < k:
        return []
    out = []
    for seg in stats.segments(steps, k):
        v = effect(*[[b[st] for st in seg] for b in by])
        if v is None or not math.isfinite(v):
            return []
        out.append(v)
    return out


def _mean(xs):
    return statistics.fmean(xs)


def _pvar(xs):
    return statistics.pvariance(xs)


def _reduction_pct(stat):
    """100 (1 - stat(b) / stat(a)): how much lower b's statistic is than a's, in %."""
    def f(a, b):
        sa = stat(a)
        return None if sa <= 0 else 100.0 * (1.0 - stat(b) / sa)
    return f


def _segmented(rows: list[dict], effect) -> dict:
    samples = _segment_effects(rows, effect)
    return {"samples": samples, "unit": "segments of the runs' training (same data order)"} if samples else {}


def claims(rows: list[dict], settings: dict, known_ids=None) -> dict[str, dict]:
    """The diagnostics claims of reports/published.yaml computed from the analysed runs.

    Direction claims carry their evidence for the claims engine: N_eff comparisons are single runs
    judged by the record's threshold (relative differences in %); gradient-norm comparisons are
    paired over ``SEGMENTS`` contiguous segments of the runs' per-step norms."""
    out: dict[str, dict] = {}
    scale = settings.get("scale", "?")
    analog = "" if scale == "paper" else f"{scale} scale: analogous run (same method and N, same r/d, or same role)"

    def put(cid: str, value, text: str = "", *, value_claim: bool = True, how: str | None = None, **evidence) -> None:
        if value is None or (known_ids is not None and cid not in known_ids):
            return
        note = "; ".join(t for t in (text, (how or analog) if value_claim and analog else "") if t)
        out[cid] = {"reproduced": value, "note": note, **evidence}

    by_row = run_rows(rows, settings)
    seed0 = _main_seed0(rows, settings)

    # N_eff at the final read (Section 4.6, Appendix D.1)
    for key, r in by_row.items():
        if r.get("n_eff"):
            prefix = "sec4.6" if key.startswith("lr.nfull.") else "appD.1"
            put(f"{prefix}.n_eff_final.{key}", r["n_eff"][-1], f"{r['run_id']}, {r.get('tokens')} tokens")
    full_lr = sorted((r for r in seed0 if r["method"] == "lr" and r["blocks"] == "full" and "sweep" in r["roles"]
                      and r.get("n_eff")), key=lambda r: r["rank"])

    def excess(lo: dict, hi: dict) -> float:
        return 100.0 * (lo["n_eff"][-1] / hi["n_eff"][-1] - 1.0)

    if len(full_lr) >= 2:
        lo, hi = full_lr[0], full_lr[-1]
        put("sec4.6.n_eff_full_decreases_with_rank", excess(lo, hi),
            f"final-read N_eff {lo['n_eff'][-1]:.6g} at r={lo['rank']} ({lo['run_id']}) vs {hi['n_eff'][-1]:.6g} at "
            f"r={hi['rank']} ({hi['run_id']}), the smallest and largest r<d of the full sweep", value_claim=False)
        mid = [r for r in full_lr if 2 * r["rank"] <= r["d_model"]]
        if mid and mid[-1] is not lo:
            put("sec4.6.n_eff_falls_r16_to_r512", excess(lo, mid[-1]),
                f"final-read N_eff {lo['n_eff'][-1]:.6g} at r={lo['rank']} vs {mid[-1]['n_eff'][-1]:.6g} at "
                f"r={mid[-1]['rank']} ({mid[-1]['run_id']}), the largest r <= d/2", value_claim=False)
    f6 = fig6_runs(rows, settings)
    at = f6["attnres"]
    low = [r for r in (f6["lr"], f6["plr"]) if r is not None and r.get("n_eff")]
    if at is not None and at.get("n_eff") and low:
        worst = min(low, key=lambda r: r["n_eff"][-1])
        who = ", ".join(f"{r['run_id']} {r['n_eff'][-1]:.6g}" for r in low)
        put("appD.1.lowrank_broader_final_read.n8", excess(worst, at),
            f"N = {at['blocks']} stands for N = 8; final-read N_eff: AttnRes {at['run_id']} {at['n_eff'][-1]:.6g} vs {who}"
            + ("" if f6["plr"] else "; no projected run at this N"), value_claim=False)

    # Appendix C.5: mean gradient norms of the 0.5B sweep
    base = next((r for r in seed0 if r["method"] == "baseline"), None)
    if base is not None:
        put("appC.5.grad_norm_mean.baseline", base["grad_norm"]["mean"], base["run_id"])
    for key, r in by_row.items():
        if key != "baseline":
            put(f"appC.5.grad_norm_mean.{key}", r["grad_norm"]["mean"], r["run_id"])
    plr_runs = [r for r in seed0 if r["method"] == "plr" and r["grad_norm"]["mean"] is not None]
    full_plr = [r for r in plr_runs if r["blocks"] == "full"]
    stand = full_plr or plr_runs

    def below(ref: dict, runs: list[dict], cid: str, extra: str) -> None:
        b = ref["grad_norm"]["mean"]
        worst = max(runs, key=lambda r: r["grad_norm"]["mean"])
        put(cid, 100.0 * (1.0 - worst["grad_norm"]["mean"] / b),
            f"{ref['run_id']} {b:.6g} vs " + ", ".join(f"{r['run_id']} {r['grad_norm']['mean']:.6g}" for r in runs) + extra,
            value_claim=False,
            **_segmented([ref, *runs], lambda a, *bs: 100.0 * (1.0 - max(_mean(x) for x in bs) / _mean(a))))

    if base is not None and base["grad_norm"]["mean"] and stand:
        below(base, stand, "appC.5.plr_full_below_baseline",
              "" if full_plr else "; no full projected run at this scale: the block projected runs stand in")
    at_full = next((r for r in seed0 if r["method"] == "attnres" and r["blocks"] == "full"
                    and "sweep" in r["roles"] and r["grad_norm"]["mean"]), None)
    if at_full is not None and full_plr:
        below(at_full, full_plr, "appC.5.plr_full_below_attnres", "")
    ctrl = next((r for r in seed0 if "control" in r["roles"]), None)
    if ctrl is not None:
        sl = next((r for r in seed0 if r["method"] == "lr" and r["blocks"] == ctrl["blocks"] and r["rank"] == ctrl["rank"]), None)
        if sl is not None and None not in (ctrl["grad_norm"]["mean"], sl["grad_norm"]["mean"]) and sl["grad_norm"]["mean"] > 0:
            put("appC.5.fullrms_above_slice", 100.0 * (ctrl["grad_norm"]["mean"] / sl["grad_norm"]["mean"] - 1.0),
                f"control {ctrl['run_id']} {ctrl['grad_norm']['mean']:.6g} vs sliced {sl['run_id']} "
                f"{sl['grad_norm']['mean']:.6g}", value_claim=False,
                **_segmented([ctrl, sl], lambda c, s_: 100.0 * (_mean(c) / _mean(s_) - 1.0)))
    for n in dict.fromkeys(r["blocks"] for r in seed0 if "sweep" in r["roles"]):
        runs = [r for r in seed0 if "sweep" in r["roles"] and r["blocks"] == n and r["method"] == "lr"
                and r["grad_norm"]["mean"] is not None]
        if runs and n in ("full", 4, 8, 16):
            g = min(runs, key=lambda r: r["grad_norm"]["mean"])
            put(f"appC.5.grad_norm_argmin_rank.n{n}", round(g["r_over_d"] * PAPER_D),
                f"{g['run_id']} (r = {g['rank']}; paper-equivalent rank r/d x {PAPER_D}) among "
                + ", ".join(f"r={r['rank']} {r['grad_norm']['mean']:.4g}" for r in sorted(runs, key=lambda r: r["rank"])))

    # Table 9 / Appendix G.1: the size pair
    for role, size in zip(("small", "large"), PAIR_SIZES):
        pair = {r["method"]: r for r in rows if f"pair-{role}" in r["roles"]}
        how = f"{scale} scale: the pair-{role} runs stand for {size.upper()}"
        for m in ("attnres", "lr"):
            r = pair.get(m)
            if r is None:
                continue
            g = r["grad_norm"]
            put(f"table9.grad_norm_mean.{size}.{m}", g["mean"], r["run_id"], how=how)
            put(f"table9.grad_norm_var.{size}.{m}", g["var"], r["run_id"], how=how)
            put(f"table9.above_clip_pct.{size}.{m}", g["above_clip_pct"], f"{r['run_id']}, threshold {g['clip']:g}", how=how)
        a, l = pair.get("attnres"), pair.get("lr")
        if a is None or l is None:
            continue
        ga, gl = a["grad_norm"], l["grad_norm"]
        who = f"{size.upper()} pair: {l['run_id']} vs {a['run_id']}"
        if ga["mean"] and gl["mean"] is not None:
            red = 100.0 * (ga["mean"] - gl["mean"]) / ga["mean"]
            put(f"appG.1.grad_norm_mean_reduction_pct.{size}", red, who, how=how)
            put(f"appG.1.lr_lower_grad_norm.{size}", red, f"{who}: mean {gl['mean']:.6g} vs {ga['mean']:.6g}",
                value_claim=False, **_segmented([a, l], _reduction_pct(_mean)))
        if ga["var"] and gl["var"] is not None:
            red = 100.0 * (ga["var"] - gl["var"]) / ga["var"]
            put(f"appG.1.grad_norm_var_reduction_pct.{size}", red, who, how=how)
            put(f"appG.1.lr_lower_grad_norm_var.{size}", red, f"{who}: variance {gl['var']:.6g} vs {ga['var']:.6g}",
                value_claim=False, **_segmented([a, l], _reduction_pct(_pvar)))
        if None not in (ga["above_clip_pct"], gl["above_clip_pct"]):
            clip = ga["clip"]

            def above(xs, clip=clip):
                return 100.0 * sum(x > clip for x in xs) / len(xs)

            put(f"appG.1.lr_fewer_clipped.{size}", ga["above_clip_pct"] - gl["above_clip_pct"],
                f"{who}: {gl['above_clip_pct']:.2f}% vs {ga['above_clip_pct']:.2f}% of steps above {clip:g}",
                value_claim=False, **_segmented([a, l], lambda x, y: above(x) - above(y)))
    return out


# ----------------------------------------------------------------------------------------- CLI


def aggregate(settings: dict, rows: list[dict], known_ids=None) -> dict:
    """The diagnostics result (without provenance) from the per-run rows of :func:`analyse_run`.

    Rows are ordered as :func:`lrattnres.gridplan.plan` orders the runs; a planned run without a row is an
    error, a row of a run that the scale does not plan is left out."""
    diag = validate_settings(settings.get("diagnostics"), "settings.diagnostics")
    by_id = {r["run_id"]: r for r in rows}
    ordered = []
    for run in plan(settings):
        if run.run_id not in by_id:
            raise DiagnosticsError(f"no diagnostics row for run {run.run_id} of the grid (diagnose it first)")
        ordered.append(by_id[run.run_id])
    return {
        "stage": "diagnostics",
        "scale": settings.get("scale"),
        "settings": diag,
        "runs": {r["run_id"]: r for r in ordered},
        "figures_data": figures_data(ordered, settings),
        "claims": claims(ordered, settings, known_ids),
    }


def diagnose(settings: dict, runs_root: Path, manifest: dict | None, known_ids=None, *, skip_missing: bool = False) -> dict:
    """The diagnostics result (without provenance) for every planned run under ``runs_root``."""
    diag = validate_settings(settings.get("diagnostics"), "settings.diagnostics")
    device = _device(diag["device"])
    rows = []
    planned = plan(settings)
    for i, run in enumerate(planned):
        folder = runs_root / run.run_id
        missing = _missing_inputs(run, folder)
        if missing:
            if skip_missing:
                log.warning("%s: %s missing; skipped", run.run_id, ", ".join(str(p) for p in missing))
                continue
            raise DiagnosticsError(f"{missing[0]}: not found (run {run.run_id} of the grid; train it first, "
                                   "or pass --skip-missing)")
        log.info("[%d/%d] %s", i + 1, len(planned), run.run_id)
        rows.append(analyse_run(run, folder, manifest, settings, diag, device))
    table = {r["run_id"]: r for r in rows}
    return {
        "stage": "diagnostics",
        "scale": settings.get("scale"),
        "settings": diag,
        "runs": table,
        "figures_data": figures_data(rows, settings),
        "claims": claims(rows, settings, known_ids),
    }


def run_attention(result: dict) -> dict | None:
    """The attention each diagnosed run's forward used, by run id (for the provenance), or None."""
    used = {rid: row["attention"] for rid, row in result.get("runs", {}).items() if row.get("attention")}
    return used or None


def _missing_inputs(run, folder: Path) -> list[Path]:
    from lrattnres.train.checkpoint import MODEL_FILE

    need = [folder / "metrics.jsonl"] + ([] if run.method == "baseline" else [folder / MODEL_FILE])
    return [p for p in need if not p.exists()]


def _read_settings(path: str) -> dict:
    settings = read_json(path)
    for key in ("grid", "presets"):
        if key not in settings:
            raise DiagnosticsError(f"{path}: settings lack {key!r} (expected the resolved settings of a scale)")
    return settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lrattnres diagnostics",
        description="routing diagnostics: N_eff, heatmaps, gradient norms, query utilisation. "
                    "--run ID analyses one run (needs its model); --aggregate ROWS... makes the figures "
                    "and claims from the per-run rows; with neither, every run of the grid in one process.")
    p.add_argument("--settings", required=True, help="resolved settings JSON of the scale")
    p.add_argument("--runs", help="folder holding one sub-folder per run id")
    p.add_argument("--data", help="data manifest (manifest.json or its folder)")
    p.add_argument("--published", help="reports/published.yaml (claim ids)")
    p.add_argument("--out", required=True, help="diagnostics result JSON (with --run: that run's row)")
    p.add_argument("--run", help="analyse this run of the grid only")
    p.add_argument("--aggregate", nargs="+", metavar="ROW_JSON", help="per-run rows written by --run")
    p.add_argument("--skip-missing", action="store_true", help="skip runs whose folder lacks the model or metrics.jsonl")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    started = now()
    settings = _read_settings(args.settings)
    if args.run and args.aggregate:
        p.error("--run and --aggregate exclude each other")
    needs = {"run": ("runs", "data"), "aggregate": ("published",), "whole": ("runs", "data", "published")}
    mode = "run" if args.run else "aggregate" if args.aggregate else "whole"
    for opt in needs[mode]:
        if getattr(args, opt) is None:
            p.error(f"--{opt} is required {'with --' + mode if mode != 'whole' else ''}".strip())

    if mode == "aggregate":
        from lrattnres.claims import load_published

        rows = []
        for path in args.aggregate:
            row = read_json(path)
            if not isinstance(row, dict) or "run_id" not in row:
                raise DiagnosticsError(f"{path}: not a diagnostics row (expected an object with 'run_id')")
            row.pop("provenance", None)
            rows.append(row)
        result = aggregate(settings, rows, set(load_published(args.published)))
        result["provenance"] = provenance(settings, started=started, attention=run_attention(result))
        atomic_write_json(args.out, result)
        log.info("diagnostics: %d runs, %d claims -> %s", len(result["runs"]), len(result["claims"]), args.out)
        return 0

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from lrattnres.data import load_manifest

    manifest = load_manifest(args.data, verify="size")
    if mode == "run":
        runs = {r.run_id: r for r in plan(settings)}
        if args.run not in runs:
            raise DiagnosticsError(f"--run {args.run}: not a run of the {settings.get('scale')} grid")
        run = runs[args.run]
        folder = Path(args.runs) / run.run_id
        missing = _missing_inputs(run, folder)
        if missing:
            raise DiagnosticsError(f"{missing[0]}: not found (train run {run.run_id} first)")
        diag = validate_settings(settings.get("diagnostics"), "settings.diagnostics")
        row = analyse_run(run, folder, manifest, settings, diag, _device(diag["device"]))
        row["provenance"] = provenance({"run": run.run_id, "diagnostics": diag}, started=started,
                                       attention=row.get("attention"))
        atomic_write_json(args.out, row)
        log.info("diagnostics: %s -> %s", run.run_id, args.out)
        return 0

    from lrattnres.claims import load_published

    known = set(load_published(args.published))
    result = diagnose(settings, Path(args.runs), manifest, known, skip_missing=args.skip_missing)
    result["provenance"] = provenance(settings, started=started, attention=run_attention(result))
    atomic_write_json(args.out, result)
    log.info("diagnostics: %d runs, %d claims -> %s", len(result["runs"]), len(result["claims"]), args.out)
    return 0
