"""The checks of a conversion (Table 2, Appendix B.2): logit differences in float64 and against the
float64 noise floor, and the paired validation cross-entropy of two models over the same windows."""

from __future__ import annotations

import copy
import math

from lrattnres.convert.construction import with_config
from lrattnres.progress import bar as progress_bar


def _fp64_view(model, device=None):
    """A float64 copy of ``model`` (on ``device``, default the model's) with the reference router and
    SDPA attention, for the FP64 check."""
    import torch

    device = next(model.parameters()).device if device is None else device
    m = copy.deepcopy(model).to(device=device, dtype=torch.float64)
    return with_config(m, router="reference", attention="sdpa")


def max_logit_diff(a, b, inputs, doc_ids=None) -> tuple[float, float]:
    """(max |logits_a - logits_b|, max |logits_a|) in the models' dtype (float64 for the check)."""
    import torch

    with torch.no_grad():
        la = a(inputs, doc_ids)
        lb = b(inputs, doc_ids)
    return float((la - lb).abs().max()), float(la.abs().max())


def max_logit_diff_to(ref, model, inputs, doc_ids=None) -> float:
    """max |logits - ref| of ``model`` on ``inputs``."""
    import torch

    with torch.no_grad():
        return float((model(inputs, doc_ids) - ref).abs().max())


def fp64_noise_floor(model64, ref, inputs, doc_ids=None, seed: int = 0) -> float:
    """How far the float64 logits move when every weight of ``model64`` is perturbed by one float64
    rounding (relative 2^-53 noise): the floor under which an FP64 logit difference is rounding
    amplified by the model's own sensitivity.  Perturbs ``model64`` in place."""
    import torch

    g = torch.Generator(device=ref.device).manual_seed(seed)
    eps = torch.finfo(torch.float64).eps / 2
    with torch.no_grad():
        for p in model64.parameters():
            p.mul_(1 + eps * torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype))
    return max_logit_diff_to(ref, model64, inputs, doc_ids)


def _autocast(device, precision: str):
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def paired_ce(models: dict, batches, device, precision: str, max_windows: int | None = None,
              progress: bool = True) -> dict:
    """Token-averaged CE of every model in ``models`` over the same windows: fp32 per-token CE, fp64
    sums.  Returns {"ce": {name: ce}, "tokens": n, "windows": w, "window_ce": {name: [per-window]}}."""
    import torch
    import torch.nn.functional as F

    sums = {n: torch.zeros((), dtype=torch.float64, device=device) for n in models}
    per_window: dict[str, list] = {n: [] for n in models}
    tokens = windows = 0

    it = progress_bar(batches, desc="[convert] paired CE", unit="batch", live=progress, leave=False)
    with torch.no_grad():
        for b in it:
            if max_windows is not None:
                take = min(b.inputs.shape[0], max_windows - windows)
                if take <= 0:
                    break
                if take < b.inputs.shape[0]:
                    b = b.head(take)
            b = b.to(device, non_blocking=True)
            inputs, targets, doc_ids = b.inputs, b.targets, b.doc_ids
            for name, m in models.items():
                with _autocast(device, precision):
                    logits = m(inputs, doc_ids, segments=b.segments)
                ce = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none")
                ce = ce.view(targets.shape).double()
                sums[name] += ce.sum()
                per_window[name].append(ce.sum(-1).cpu())
            tokens += targets.numel()
            windows += targets.shape[0]
    out = {"ce": {n: float(s / tokens) if tokens else float("nan") for n, s in sums.items()},
           "tokens": tokens, "windows": windows,
           "window_ce": {n: (torch.cat(v) if v else torch.zeros(0, dtype=torch.float64)) for n, v in per_window.items()}}
    return out


def _paired_se(a, b, seq_len: int) -> float | None:
    """Standard error of the token-averaged difference from per-window sums (windows of equal length)."""
    n = a.numel()
    if n < 2:
        return None
    diff = (b - a) / seq_len
    return float(diff.std(unbiased=True) / math.sqrt(n))
