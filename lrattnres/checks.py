"""Type tests of the values a stage reads from its JSON or YAML settings.

JSON's ``true`` loads as a Python ``bool``, which is an ``int``: a count, a seed or a size must be an
``int`` that is not a ``bool``.  A number must be finite (``NaN`` and ``Infinity`` parse from JSON).
Each stage states its own ranges and raises :class:`lrattnres.errors.SpecError` (or its own error)
with the key and what it expected.
"""

from __future__ import annotations

import math
from typing import Any


def is_int(x: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
