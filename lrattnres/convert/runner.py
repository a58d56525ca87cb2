"""One conversion end to end: the spec, the conversion and its FP64 check, the export and strict
reload, and the paired validation cross-entropy (the result JSON of ``python -m lrattnres convert``)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from lrattnres.checks import is_int
from lrattnres.convert.construction import _check_source, convert_model, with_config
from lrattnres.convert.summary import parse_claim_row, published_records, result_claims
from lrattnres.convert.verify import _autocast, _fp64_view, _paired_se, fp64_noise_floor, max_logit_diff_to, paired_ce
from lrattnres.data import iter_eval_batches, load_manifest, manifest_sha256
from lrattnres.devices import resolve_device
from lrattnres.errors import SpecError
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.convert")


SPEC_KEYS = {"rank", "val_tokens", "batch_size", "claim_row", "precision", "device", "rtol", "seq_len", "export_dtype"}
SPEC_REQUIRED = ("rank", "batch_size")


def validate_spec(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise SpecError(f"--spec: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise SpecError(f"spec.{unknown[0]}: unknown key (expected {sorted(SPEC_KEYS)})")
    for k in SPEC_REQUIRED:
        if k not in spec:
            raise SpecError(f"spec.{k}: missing (required)")
    out = {"val_tokens": None, "claim_row": None, "precision": "auto", "device": "auto", "rtol": None,
           "seq_len": None, "export_dtype": "bf16", **spec}
    if out["export_dtype"] not in ("bf16", "storage"):
        raise SpecError(f"spec.export_dtype: expected 'bf16' or 'storage', got {out['export_dtype']!r}")
    if not (is_int(out["rank"]) or isinstance(out["rank"], str)):
        raise SpecError(f"spec.rank: expected an int, 'd', 'd/<k>' or 'k', got {out['rank']!r}")
    for k, lo in (("batch_size", 1), ("val_tokens", 1), ("seq_len", 1)):
        v = out[k]
        if v is None and k != "batch_size":
            continue
        if not is_int(v) or v < lo:
            raise SpecError(f"spec.{k}: expected an int >= {lo}{'' if k == 'batch_size' else ' or null'}, got {v!r}")
    if out["precision"] not in ("auto", "bf16", "fp32"):
        raise SpecError(f"spec.precision: expected 'auto', 'bf16' or 'fp32', got {out['precision']!r}")
    if out["rtol"] is not None and not (isinstance(out["rtol"], (int, float)) and out["rtol"] >= 0):
        raise SpecError(f"spec.rtol: expected a number >= 0 or null, got {out['rtol']!r}")
    parse_claim_row(out["claim_row"])
    return out


def _export(conv_model, dtype, device):
    """The converted model with weights rounded to the export dtype (what ``--save`` writes)."""
    import torch

    from lrattnres.model import build_model

    with torch.device(device):
        m = build_model(conv_model.cfg)
    m.to(dtype)
    m.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in conv_model.state_dict().items()}, strict=True)
    return m.eval()


@dataclasses.dataclass
class _Source:
    """The checkpoint to convert, as loaded, with the data it is checked on."""

    checkpoint: str | Path
    model: Any
    info: dict
    run_id: str
    manifest: dict
    msha: str
    claim_row: str | None

    @property
    def cfg(self):
        return self.model.cfg


def run(checkpoint: str | Path, data: str | Path, spec: dict, save: str | Path | None = None,
        published: str | Path | None = None, progress: bool = True) -> dict:
    """Convert one checkpoint and check it; returns the result JSON (see the module doc)."""
    from lrattnres.attention import describe as describe_attention

    started = now()
    t0 = time.perf_counter()
    spec = validate_spec(spec)
    device = resolve_device(spec["device"], where="spec.device")
    precision = spec["precision"]
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    src = _read_source(checkpoint, data, spec)
    check = _convert_and_check(src, spec, device)
    reloaded, saved = _export_and_reload(src, check, save, device)
    native_err = _native_routing_err(reloaded, check, device)
    models, ce, seq_len = _paired_validation(src, spec, reloaded, device, precision, progress)
    result = _result(src, spec, check, reloaded, ce, seq_len, precision, device, native_err, saved)
    result["wall_s"] = time.perf_counter() - t0
    result["peak_gpu_mem_gib"] = _peak_gpu_mem_gib(device)
    result["claims"] = result_claims(result, published_records(published))
    # the attention each forward ran: the FP64 check in SDPA, the paired CE in each model's own
    attention = {"fp64_check": describe_attention("sdpa", device),
                 **{name: describe_attention(m.cfg.attention, device) for name, m in models.items()}}
    result["provenance"] = provenance({"checkpoint": str(checkpoint), "spec": spec}, started=started,
                                      attention=attention)
    return result


def _peak_gpu_mem_gib(device) -> float | None:
    import torch

    return (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None


def _read_source(checkpoint: str | Path, data: str | Path, spec: dict) -> _Source:
    """The checkpoint (a standard AttnRes model) and the data manifest it is checked on."""
    from lrattnres.train import checkpoint as ckpt

    model, info = ckpt.load_model(checkpoint, "cpu")
    cfg = model.cfg
    _check_source(cfg)
    run_id = (info.get("spec") or {}).get("run_id") or Path(checkpoint).resolve().parent.name
    manifest = load_manifest(data)
    msha = manifest_sha256(manifest)
    if info.get("manifest_sha256") and info["manifest_sha256"] != msha:
        log.warning("%s was trained on data manifest %s, evaluating on %s; pass the manifest it was trained on "
                    "(--data) to compare on its own validation split", checkpoint, info["manifest_sha256"][:12], msha[:12])
    if manifest.get("vocab_size") is not None and manifest["vocab_size"] > cfg.vocab_size:
        raise ValueError(f"{data}: vocab_size {manifest['vocab_size']} exceeds the checkpoint's {cfg.vocab_size}")
    claim_row = spec["claim_row"]
    parsed = parse_claim_row(claim_row)
    if parsed is not None and parsed[1] != f"n{cfg.blocks}":
        log.warning("claim_row %s names N=%s but the checkpoint routes with blocks=%s: its claims stand for "
                    "another row of Table 2; give the spec the claim_row of the checkpoint's N", claim_row,
                    parsed[1][1:], cfg.blocks)
    return _Source(checkpoint, model, info, run_id, manifest, msha, claim_row)


def _fp64_sequence(src: _Source, device):
    """The validation sequence of the FP64 check: one full-length window, or the whole split where it is shorter."""
    L = src.cfg.max_seq_len
    first = iter_eval_batches(src.manifest, "val", 1, L)
    if len(first) == 0:  # a validation split shorter than one full-length window
        fp64_len = max(1, first.tokens_total - 1)
        log.warning("validation split holds %d tokens: the FP64 check uses %d, not max_seq_len=%d (a larger "
                    "data.val_tokens checks a full-length sequence)", first.tokens_total, fp64_len, L)
        first = iter_eval_batches(src.manifest, "val", 1, fp64_len)
    seq = next(iter(first))
    return seq.inputs.to(device), seq.doc_ids.to(device)


def _convert_and_check(src: _Source, spec: dict, device) -> dict[str, Any]:
    """The conversion in float64 and its check on one sequence: the converted model's logits and
    routing weights against the original's, the slice drift, both exported copies' error and the
    float64 noise floor; with the exported models (``conv_export``, ``orig_export``) and the sequence."""
    import torch

    model, cfg = src.model, src.cfg
    log.info("%s: %s N=%s d=%d, %d active queries", src.run_id, cfg.method, cfg.blocks, cfg.d_model, 2 * cfg.n_layers)
    storage = next(model.parameters()).dtype
    orig64 = _fp64_view(model, device)  # the original stays on the CPU in its dtype until the CE pass
    conv = convert_model(orig64, spec["rank"], rtol=spec["rtol"], dtype=torch.float64, device=device)
    conv64 = with_config(conv.model, router="reference", attention="sdpa")
    log.info("joint rank k=%d of %d; converting d=%d -> r=%d (query residual %.3g)", conv.span.joint_rank,
             conv.span.active_queries, cfg.d_model, conv.rank, conv.query_residual)
    inputs, doc_ids = _fp64_sequence(src, device)
    with torch.no_grad():
        ref, w_orig = orig64(inputs, doc_ids, return_routing=True)
        err, scale = max_logit_diff_to(ref, conv64, inputs, doc_ids), float(ref.abs().max())
        slice_err = max_logit_diff_to(ref, with_config(conv64, method="lr"), inputs, doc_ids)
        _, w_conv = conv64(inputs, doc_ids, return_routing=True)
    routing_err = max(float((a - b).abs().max()) for a, b in zip(w_orig, w_conv))
    del w_orig, w_conv
    spectrum, qres = conv.span, conv.query_residual
    edtype = torch.bfloat16 if spec["export_dtype"] == "bf16" else storage
    conv_export = _export(conv.model, edtype, device)
    orig_export = _export(model, edtype, device)
    del conv64, conv  # free the float64 converted model before the exported copy's check
    exported_err = max_logit_diff_to(ref, _fp64_view(conv_export), inputs, doc_ids)
    exported_orig_err = max_logit_diff_to(ref, _fp64_view(orig_export), inputs, doc_ids)
    noise_floor = fp64_noise_floor(orig64, ref, inputs, doc_ids)  # perturbs orig64: last use
    log.info("FP64 max logit error %.3e (logit scale %.3g; float64 noise floor %.3e), routing weights %.3e; "
             "exported (%s) %.3e, the original exported %.3e; slice drift %.3e", err, scale, noise_floor, routing_err,
             str(edtype).replace("torch.", ""), exported_err, exported_orig_err, slice_err)
    del orig64, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"err": err, "scale": scale, "slice_err": slice_err, "routing_err": routing_err, "spectrum": spectrum,
            "qres": qres, "edtype": edtype, "exported_err": exported_err, "exported_orig_err": exported_orig_err,
            "noise_floor": noise_floor, "inputs": inputs, "doc_ids": doc_ids, "conv_export": conv_export,
            "orig_export": orig_export}


def _export_and_reload(src: _Source, check: dict, save: str | Path | None, device) -> tuple[dict, str | None]:
    """Appendix B.2: both exported models written and strictly reloaded (sha256, every parameter);
    ({"original": model, "converted": model} on ``device``, the saved path or None)."""
    import torch

    from lrattnres.train import checkpoint as ckpt

    info, spectrum, edtype = src.info, check["spectrum"], check["edtype"]
    conv_export, orig_export = check.pop("conv_export"), check.pop("orig_export")
    meta = {"model_config": dataclasses.asdict(conv_export.cfg), "spec": info.get("spec"),
            "manifest_sha256": info.get("manifest_sha256"), "step": info.get("step"), "tokens": info.get("tokens"),
            "converted_from": {"checkpoint": str(src.checkpoint), "run_id": src.run_id, "joint_rank": spectrum.joint_rank,
                               "rank": int(conv_export.cfg.rank), "method": "lr-fullrms", "rtol": spectrum.rtol},
            "export_dtype": str(edtype).replace("torch.", "")}
    with tempfile.TemporaryDirectory(prefix="lrattnres-convert-") as tmp:
        paths = {"original": Path(tmp) / "original.safetensors",
                 "converted": Path(save) if save is not None else Path(tmp) / "converted.safetensors"}
        reloaded = {}
        for name, m, info_ in (("original", orig_export, {**info, "export_dtype": meta["export_dtype"]}),
                               ("converted", conv_export, meta)):
            weights = {k: v.detach().cpu() for k, v in m.state_dict().items()}
            ckpt.save_model(weights, {k: v for k, v in info_.items() if k != "path"}, paths[name])
            back, _ = ckpt.load_model(paths[name], "cpu")  # strict reload: sha256, every parameter
            for k, v in back.state_dict().items():
                if not torch.equal(v.to(weights[k].dtype), weights[k]):
                    raise RuntimeError(f"{paths[name]}: parameter {k} changed in the export and reload")
            reloaded[name] = back.to(device).eval()
        del orig_export, conv_export
    saved = str(save) if save is not None else None
    if saved:
        log.info("saved the converted checkpoint to %s", save)
    return reloaded, saved


def _native_routing_err(reloaded: dict, check: dict, device) -> float | None:
    """On a GPU, the reloaded models' native routing against the reference on the check's sequence."""
    import torch

    if device.type != "cuda":
        return None
    inputs, doc_ids = check["inputs"], check["doc_ids"]
    with torch.no_grad(), _autocast(device, "bf16"):
        return max(float((with_config(m, router="fused")(inputs, doc_ids).float()
                          - with_config(m, router="reference")(inputs, doc_ids).float()).abs().max())
                   for m in reloaded.values())


def _paired_validation(src: _Source, spec: dict, reloaded: dict, device, precision: str,
                       progress: bool) -> tuple[dict, dict, int]:
    """The paired validation cross-entropy of the original, the converted model and the converted
    weights under slice normalisation; (the models, paired_ce's result, the sequence length)."""
    L = src.cfg.max_seq_len
    seq_len = spec["seq_len"] or (src.info.get("spec") or {}).get("seq_len") or L
    seq_len = min(int(seq_len), L)
    batches = iter_eval_batches(src.manifest, "val", spec["batch_size"], seq_len)
    max_windows = None if spec["val_tokens"] is None else max(1, spec["val_tokens"] // seq_len)
    models = {"original": reloaded["original"], "converted": reloaded["converted"],
              "slice": with_config(reloaded["converted"], method="lr")}
    ce = paired_ce(models, batches, device, precision, max_windows, progress=progress)
    orig_ce, conv_ce, slice_ce = ce["ce"]["original"], ce["ce"]["converted"], ce["ce"]["slice"]
    log.info("paired CE over %d tokens (%s): original %.6f converted %.6f delta %+.3e; slice %.6f",
             ce["tokens"], precision, orig_ce, conv_ce, conv_ce - orig_ce, slice_ce)
    return models, ce, seq_len


def _result(src: _Source, spec: dict, check: dict, reloaded: dict, ce: dict, seq_len: int, precision: str, device,
            native_err: float | None, saved: str | None) -> dict[str, Any]:
    """The conversion's result JSON (without its wall time, claims and provenance)."""
    cfg, spectrum, err, scale, slice_err = src.cfg, check["spectrum"], check["err"], check["scale"], check["slice_err"]
    orig_ce, conv_ce, slice_ce = ce["ce"]["original"], ce["ce"]["converted"], ce["ce"]["slice"]
    wce = ce["window_ce"]
    return {
        "stage": "convert",
        "run_id": src.run_id,
        "source_checkpoint": str(src.checkpoint),
        "method": cfg.method,
        "converted_method": "lr-fullrms",
        "blocks": cfg.blocks,
        "n_layers": cfg.n_layers,
        "d": cfg.d_model,
        "rank": int(reloaded["converted"].cfg.rank),
        "joint_rank": spectrum.joint_rank,
        "active_queries": spectrum.active_queries,
        "rtol": spectrum.rtol,
        "singular_values": spectrum.singular_values,
        "query_residual": check["qres"],
        "fp64_seq_len": int(check["inputs"].shape[1]),
        "fp64_max_logit_err": err,
        "logit_scale": scale,
        "fp64_noise_floor": check["noise_floor"],
        "fp64_rel_logit_err": err / scale if scale > 0 else None,
        "routing_max_err": check["routing_err"],
        "exported_dtype": str(check["edtype"]).replace("torch.", ""),
        "exported_max_logit_err": check["exported_err"],
        "exported_original_max_logit_err": check["exported_orig_err"],
        "native_vs_reference_max_logit_err": native_err,
        "original_ce": orig_ce,
        "converted_ce": conv_ce,
        "delta_ce": conv_ce - orig_ce,
        "delta_ce_se": _paired_se(wce["original"], wce["converted"], seq_len),
        "val_tokens_evaluated": ce["tokens"],
        "val_windows": ce["windows"],
        "seq_len": seq_len,
        "precision": precision,
        "device": str(device),
        "slice_drift": {
            "method": "lr",
            "max_logit_err": slice_err,
            "rel_logit_err": slice_err / scale if scale > 0 else None,
            "ce": slice_ce,
            "delta_ce": slice_ce - orig_ce,
            "note": "converted weights run with slice normalisation (RMS over the last r coordinates); "
                    "Proposition 1 does not cover this",
        },
        "claim_row": src.claim_row,
        "manifest_sha256": src.msha,
        "saved": saved,
        "spec": spec,
    }
