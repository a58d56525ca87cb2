"""Fused Triton depth routing behind torch.library ops.

``attnres(sources, query, *, norm="slice", eps=1e-6, settings=DEFAULT)`` has the semantics of
``lrattnres.routing.route``; ``kernels.naive`` writes the kernels' math out in torch.  docs/kernel.md
says where each part is, how to change it and how to measure it.
"""

from .autograd import attnres, attnres_bwd, attnres_fwd, attnres_triton
from .dispatch import tuned_configs
from .settings import DEFAULT, Settings

__all__ = ["attnres", "attnres_triton", "attnres_fwd", "attnres_bwd", "Settings", "DEFAULT", "tuned_configs"]
