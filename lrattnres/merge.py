"""Recursive merge of nested settings: a scale refining ``base``, an override refining a scale, a
run's spec refining a stage's defaults. No other module of the package is imported here, so that
every layer can merge settings."""

from __future__ import annotations

import copy


def deep_merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; ``override`` wins; neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
