"""Learning-rate schedule of Section 4.1: linear warmup, constant, linear warmdown.

``lr_multiplier(step, ...)`` is the factor applied to every group's base learning rate for the
update with 0-based index ``step`` (the first update is step 0).  The schedule is a pure function of
the step, so a resumed run recomputes it exactly from the saved step counter.

* warmup: ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` updates (reaches 1 at the
  last warmup update, never 0 at the first);
* constant 1 afterwards;
* warmdown over the last ``round(warmdown_frac * total_steps)`` updates, linear from 1 towards
  ``final_lr_frac``: ``final + (1 - final) * (total_steps - step) / warmdown_steps`` (the last update
  uses ``final + (1 - final) / warmdown_steps``; the paper states no floor, so ``final_lr_frac``
  defaults to 0 in the spec).

Where warmup and warmdown overlap (very short runs) the smaller factor wins.
"""

from __future__ import annotations


def warmdown_steps(total_steps: int, warmdown_frac: float) -> int:
    return int(round(warmdown_frac * total_steps))


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int,
    warmdown_frac: float,
    final_lr_frac: float = 0.0,
) -> float:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} outside [0, {total_steps})")
    mult = 1.0
    if warmup_steps > 0 and step < warmup_steps:
        mult = min(mult, (step + 1) / warmup_steps)
    wd = warmdown_steps(total_steps, warmdown_frac)
    if wd > 0 and step >= total_steps - wd:
        mult = min(mult, final_lr_frac + (1.0 - final_lr_frac) * (total_steps - step) / wd)
    return mult


def apply_lr(optimizers: dict, base_lrs: dict, mult: float) -> dict[str, float]:
    """Set every group's lr to ``base * mult``; returns the lr per optimiser name (for logging)."""
    out = {}
    for name, opt in optimizers.items():
        lr = base_lrs[name] * mult
        for group in opt.param_groups:
            group["lr"] = lr
        out[name] = lr
    return out
