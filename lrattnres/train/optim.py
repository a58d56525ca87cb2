"""Optimisers of Section 4.1: Muon for the >=2-D transformer weights, AdamW for the rest.

The split (the author's repository, jon123boss/LR-AttnRes): Muon takes every >=2-D weight of the transformer
body; AdamW takes the token embedding (``embed.*``), the output head (``head.*``), the routing
queries (a parameter named ``queries``, at any depth) and every 1-D parameter.  The rule lives in
:func:`is_adam_param` and is tested.

Muon is ``torch.optim.Muon`` (PyTorch >= 2.9).  Its semantics, checked against torch 2.13's source:
momentum buffer ``B <- mu B + (1 - mu) g`` (an EMA, like Keller Jordan's reference), Nesterov update
``g + mu (B - g)``, 5 quintic Newton-Schulz steps in bf16 (coefficients 3.4445, -4.7750, 2.0315),
decoupled weight decay ``theta <- theta (1 - lr wd)``, then ``theta <- theta - lr * sqrt(max(1, A/B)) O``
for a weight of shape [A, B] (``adjust_lr_fn="original"``).  It accepts only 2-D parameters, so a
>2-D weight is refused here with its name.  The author's repository used a different Muon variant
(Polar-Express iterations with a second-moment rescale); the paper names plain Muon, which is
what this uses.

One change: the Newton-Schulz dtype is a spec key (``optim.muon.ns_dtype``).  torch runs the
iteration in bf16, which is right on a GPU but about 30x slower than fp32 on a CPU without bf16
matrix units (measured: 2.3 ms vs 0.08 ms for a 64x256 @ 256x64 product on this machine's AVX2
cores), where it made Muon the most expensive part of a tiny step.  ``auto`` (the default) keeps
bf16 on CUDA and uses fp32 on the CPU; with ``bf16`` :class:`Muon` is bit-identical to
``torch.optim.Muon`` (tested).

Every hyper-parameter comes from the spec (``optim.muon`` / ``optim.adam``).
"""

from __future__ import annotations

import torch
from torch import nn

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _newton_schulz(grad: torch.Tensor, coeffs, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz with the iteration dtype as a parameter."""
    a, b, c = coeffs
    x = grad.to(dtype, copy=True)  # never divide the momentum buffer in place
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    return x.T if tall else x


_MuonBase = getattr(torch.optim, "Muon", torch.optim.Optimizer)


class Muon(_MuonBase):
    """``torch.optim.Muon`` with the Newton-Schulz iteration run in ``ns_dtype`` (bf16 = torch's)."""

    def __init__(self, params, *, ns_dtype: str = "bf16", **kw):
        if _MuonBase is torch.optim.Optimizer:
            raise RuntimeError(f"torch.optim.Muon needs PyTorch >= 2.9; this is torch {torch.__version__}")
        super().__init__(params, **kw)
        self.ns_dtype = _DTYPES[ns_dtype]

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import _adjust_lr

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mom)
                update = grad.lerp(buf, mom) if group["nesterov"] else buf
                update = _newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss

ADAM_PREFIXES = ("embed.", "head.")
QUERY_NAME = "queries"


def _strip(name: str) -> str:
    # torch.compile and DDP wrap modules; parameter names then carry these prefixes.
    for prefix in ("_orig_mod.", "module."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def is_adam_param(name: str, param: torch.Tensor) -> bool:
    """True for parameters AdamW updates; False for those Muon updates."""
    name = _strip(name)
    if param.ndim < 2:
        return True
    if name.startswith(ADAM_PREFIXES) or name in ("embed", "head"):
        return True
    last = name.rsplit(".", 1)[-1]
    return last == QUERY_NAME


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(muon, adam) lists of (name, parameter), trainable parameters only, in module order."""
    muon, adam = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_adam_param(name, p):
            adam.append((name, p))
        else:
            if p.ndim != 2:
                raise ValueError(
                    f"parameter {_strip(name)!r} has shape {tuple(p.shape)}: Muon takes 2-D weights only; "
                    "reshape it in the model or extend lrattnres.train.optim.is_adam_param"
                )
            muon.append((name, p))
    return muon, adam


def build_optimizers(model: nn.Module, optim_spec: dict, device_type: str = "cpu",
                     shard: bool = False) -> dict[str, torch.optim.Optimizer]:
    """``{"muon": Muon, "adam": AdamW}`` (a group that would be empty is left out).

    ``shard``: each wrapped in ``torch.distributed.optim.ZeroRedundancyOptimizer`` (the process group
    must be initialised): every rank keeps the state of the whole parameters it owns (largest first,
    each to the least-loaded rank), steps them and broadcasts them to the others. Muon
    orthogonalises each weight matrix on its own and AdamW works element by element, so the update is
    the unsharded one; the state of each optimiser is divided over the ranks."""
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch.optim.Muon needs PyTorch >= 2.9; this is torch {torch.__version__}")
    muon_params, adam_params = split_params(model)
    out: dict[str, torch.optim.Optimizer] = {}

    def make(cls, params, **kw):
        if not shard:
            return cls(params, **kw)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kw)

    m = optim_spec["muon"]
    if muon_params:
        ns = m["ns_dtype"]
        if ns == "auto":
            ns = "bf16" if device_type == "cuda" else "fp32"
        out["muon"] = make(
            Muon,
            [p for _, p in muon_params],
            ns_dtype=ns,
            lr=m["lr"],
            momentum=m["momentum"],
            weight_decay=m["weight_decay"],
            nesterov=m["nesterov"],
            ns_steps=m["ns_steps"],
            adjust_lr_fn=m["adjust_lr_fn"],
        )
    a = optim_spec["adam"]
    if adam_params:
        out["adam"] = make(
            torch.optim.AdamW,
            [p for _, p in adam_params],
            lr=a["lr"],
            betas=tuple(a["betas"]),
            eps=a["eps"],
            weight_decay=a["weight_decay"],
            fused=device_type == "cuda",
        )
    return out


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimiser that holds this rank's state: a ZeroRedundancyOptimizer's local one, else itself."""
    return getattr(opt, "optim", opt)


def owners(optimizers: dict[str, torch.optim.Optimizer], names: dict[int, str], world: int) -> dict[str, int]:
    """Parameter name -> the rank that owns it: ZeroRedundancyOptimizer's partition of each optimiser's
    parameters (largest first, each to the least-loaded rank, the lowest rank on ties), whether or not
    the optimisers are sharded. Checkpoints use it to divide the writing between the ranks."""
    out: dict[str, int] = {}
    for opt in optimizers.values():
        load = [0] * world
        for group in opt.param_groups:
            for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                r = load.index(min(load))
                load[r] += p.numel()
                out[names[id(p)]] = r
    return out


def base_lrs(optim_spec: dict) -> dict[str, float]:
    return {"muon": float(optim_spec["muon"]["lr"]), "adam": float(optim_spec["adam"]["lr"])}
