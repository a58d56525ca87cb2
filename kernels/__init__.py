"""Fast-AttnRes: fused Triton depth routing behind a torch.library op.

``attnres(sources, query, *, norm="slice", eps=1e-6)`` has the semantics of
``lrattnres.routing.route`` (see the ``kernels.op`` module docstring and docs/kernel_notes.md).
"""

from .op import attnres, attnres_triton, attnres_fwd, attnres_bwd, set_cpu_triton

__all__ = ["attnres", "attnres_triton", "attnres_fwd", "attnres_bwd", "set_cpu_triton"]
