"""Loss terms and validation cross-entropy.

Training loss per token: ``ce = logsumexp(z) - z[target]`` and the z-loss term
``z_loss * logsumexp(z)^2`` (counted once), both computed from fp32 logits and averaged over the
valid tokens of the whole global batch.  Targets equal to ``IGNORE_INDEX`` are left out.

Validation cross-entropy is token-averaged: per-token CE in fp32, summed in fp64, divided by the
token count; across data-parallel ranks the fp64 sums and counts are all-reduced.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def loss_sums(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sums over valid tokens of per-token cross-entropy and of logsumexp^2.

    One log-softmax serves both terms: ``ce = -logp[target]`` and ``lse = z_0 - logp_0``.
    """
    logits = logits.float()
    logp = logits.log_softmax(dim=-1)
    lse = logits[..., 0] - logp[..., 0]
    valid = targets != IGNORE_INDEX
    ce = -logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    ce_sum = torch.where(valid, ce, zero).sum()
    z_sum = torch.where(valid, lse.square(), zero).sum()
    return ce_sum, z_sum


def autocast_ctx(device: torch.device, precision: str):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    device: torch.device,
    precision: str = "fp32",
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """Token-averaged validation cross-entropy over ``batches`` (the first ``max_batches`` if given).

    With several ranks, batch ``i`` is evaluated by rank ``i % world_size`` and the sums are
    all-reduced, so the result does not depend on the number of ranks.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for i, b in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            if i % world_size != rank:
                continue
            inputs = b.inputs.to(device, non_blocking=True)
            targets = b.targets.to(device, non_blocking=True)
            doc_ids = b.doc_ids.to(device, non_blocking=True) if getattr(b, "doc_ids", None) is not None else None
            with autocast_ctx(device, precision):
                logits = model(inputs, doc_ids)
            per_tok = F.cross_entropy(
                logits.float().flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
            )
            valid = targets.flatten() != IGNORE_INDEX
            total += per_tok[valid].double().sum()
            count += valid.sum().double()
    finally:
        model.train(was_training)
    if world_size > 1:
        import torch.distributed as dist

        packed = torch.stack([total, count])
        dist.all_reduce(packed)
        total, count = packed[0], packed[1]
    n = count.item()
    return {"ce": (total / count).item() if n > 0 else float("nan"), "tokens": int(n)}
