"""The torch device a stage runs on, from its ``device`` setting.

``auto`` is the GPU where CUDA is available, else the CPU; ``cpu``; ``cuda`` (the current GPU: the
one :mod:`lrattnres.gpus` or the batch system made visible) or ``cuda:N``.  A GPU asked for where
none is available stops the stage with a message naming the setting.
"""

from __future__ import annotations

import re

from lrattnres.errors import SpecError


def resolve_device(name, *, where: str = "device", error: type[Exception] = SpecError):
    """The ``torch.device`` of setting ``name`` (a string or a device).

    ``where`` names the setting in messages (e.g. ``"diagnostics.device"``); ``error`` is the class
    raised for a name that is not a device and for a GPU where CUDA is not available."""
    import torch

    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise error(f"{where}: expected auto, cpu, cuda or cuda:N, got {name!r}")
    if name != "cpu" and not torch.cuda.is_available():
        raise error(f"{where}: {name!r} asked for, but no CUDA device is available")
    return torch.device(name)
