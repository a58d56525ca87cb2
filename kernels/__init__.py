"""Fused Triton depth routing behind a torch.library op.

``attnres(sources, query, *, norm="slice", eps=1e-6)`` has the semantics of
``lrattnres.routing.route``; ``kernels.naive`` writes the kernels' math out in torch.  See the
``kernels.op`` module docstring for where the code is, and docs/kernel.md.
"""

from .op import attnres, attnres_triton, attnres_fwd, attnres_bwd, set_cpu_triton

__all__ = ["attnres", "attnres_triton", "attnres_fwd", "attnres_bwd", "set_cpu_triton"]
