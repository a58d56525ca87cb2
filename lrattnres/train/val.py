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


class _CEZ(torch.autograd.Function):
    """Sums of per-token CE and of logsumexp^2 over valid rows, with a one-pass backward.

    Forward: max, exp, sum (the numerators are kept); backward:
    ``dlogits = p * (g_ce + 2 g_z lse) - g_ce * onehot(target)`` on valid rows.  Eager PyTorch
    would run log-softmax and its backward plus extra full-size passes for the second term; this
    is about 2x cheaper on a CPU.  Under torch.compile the plain formulation is used instead
    (Inductor fuses it).
    """

    @staticmethod
    def forward(ctx, logits, targets):
        x = logits.float()
        m = x.amax(dim=-1, keepdim=True)
        e = (x - m).exp_()  # softmax numerators; normalised in the backward pass
        s = e.sum(dim=-1, keepdim=True)
        lse = (m + s.log()).squeeze(-1)
        valid = targets != IGNORE_INDEX
        t = targets.clamp_min(0).unsqueeze(-1)
        ce = lse - x.gather(-1, t).squeeze(-1)
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        ce_sum = torch.where(valid, ce, zero).sum()
        z_sum = torch.where(valid, lse.square(), zero).sum()
        ctx.save_for_backward(e, s, lse, t, valid)
        ctx.in_dtype = logits.dtype
        return ce_sum, z_sum

    @staticmethod
    def backward(ctx, g_ce, g_z):
        e, s, lse, t, valid = ctx.saved_tensors
        coef = torch.where(valid, g_ce + 2.0 * g_z * lse, torch.zeros((), dtype=lse.dtype, device=lse.device))
        grad = e.mul_(coef.unsqueeze(-1) / s)  # in place: the backward of this node runs once
        grad.scatter_add_(-1, t, torch.where(valid, -g_ce, 0.0).to(grad.dtype).expand(t.shape[:-1]).unsqueeze(-1).contiguous())
        return grad.to(ctx.in_dtype), None


def loss_sums(logits: torch.Tensor, targets: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sums over valid tokens of per-token cross-entropy and of logsumexp^2.

    ``fused`` (default: when not being compiled) uses :class:`_CEZ`; otherwise the plain
    formulation ``ce = logsumexp(z) - z[target]``, which Inductor turns into one reduction kernel
    forward and one fused pointwise pass backward, keeping only the (bf16) logits and ``lse``.
    """
    if fused is None:
        fused = not torch.compiler.is_compiling()
    if fused:
        return _CEZ.apply(logits, targets)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != IGNORE_INDEX
    ce = lse - x.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
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
            segments = getattr(b, "segments", None)
            segments = segments.to(device, non_blocking=True) if segments is not None else None
            with autocast_ctx(device, precision):
                logits = model(inputs, doc_ids, segments=segments)
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
