"""One run analysed beside its model: its routing on the held-out tokens, its queries and its logged
gradient norms (the ``--run`` mode of ``python -m lrattnres diagnostics``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from lrattnres.checks import is_number
from lrattnres.data import iter_eval_batches
from lrattnres.devices import resolve_device
from lrattnres.diagnostics.measures import (_thin, grad_norm_stats, query_utilisation, read_grad_norms,
                                            routing_diagnostics, source_columns, trailing_mean)
from lrattnres.diagnostics.settings import DiagnosticsError
from lrattnres.gridplan import paper_row
from lrattnres.io import read_json
from lrattnres.presets import get_preset

log = logging.getLogger("lrattnres.diagnostics")


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
                log.warning("%s: trained on manifest sha256 %s..., diagnosing on %s...; pass the manifest it was "
                            "trained on (--data) to diagnose it on its own data", run.run_id,
                            str(info["manifest_sha256"])[:12], str(manifest.get("_sha256"))[:12])

            seq_len = diag["seq_len"] or (info.get("spec") or {}).get("seq_len") or cfg.max_seq_len
            if seq_len > cfg.max_seq_len:
                raise DiagnosticsError(f"diagnostics.seq_len={seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
            windows = -(-diag["tokens"] // seq_len)
            batches = iter_eval_batches(manifest, diag["split"], diag["batch_size"], seq_len,
                                        max_batches=-(-windows // diag["batch_size"]), verify=False)
            if batches.tokens_covered < diag["tokens"]:
                log.warning("%s: split %r holds %d windows of %d tokens, fewer than the %d tokens asked for; the "
                            "measures use them all (a larger data.val_tokens, or fewer diagnostics.tokens, gives "
                            "what was asked)", run.run_id, diag["split"], batches.n_windows, seq_len, diag["tokens"])
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


def _missing_inputs(run, folder: Path) -> list[Path]:
    from lrattnres.train.checkpoint import MODEL_FILE

    need = [folder / "metrics.jsonl"] + ([] if run.method == "baseline" else [folder / MODEL_FILE])
    return [p for p in need if not p.exists()]
