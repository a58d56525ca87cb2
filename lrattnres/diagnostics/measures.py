"""The measures of a run: N_eff and the mean depth-wise attention from its routing weights (Eq. 14,
Figures 4 and 8), gradient-norm statistics from its log (Table 9, Figure 10), the coordinate effective
dimension of its queries (Appendix E.2, Table 6).  Functions of tensors and logged numbers."""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any

from lrattnres.diagnostics.settings import DiagnosticsError

log = logging.getLogger("lrattnres.diagnostics")

# Table 6's groups of query sites, and all of them together
QUERY_GROUPS = ("pre_attention", "pre_mlp", "final_output", "all")


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
