"""Checkpoints: resumable training state, and the final weights later stages load.

``checkpoint.pt`` (resumable; written atomically, periodically, on SIGTERM and at the end):

    {"format": "lrattnres.train.checkpoint/1", "kind": "checkpoint",
     "model": state_dict, "model_config": {...ModelConfig fields...},
     "optimizers": {"muon": state_dict, "adam": state_dict},
     "step": <updates done>, "tokens": <tokens consumed>, "wall_s": <training seconds so far>,
     "grad_norms": [pre-clip norm per step], "rng": [per rank {"torch", "numpy", "python", "cuda"}],
     "loader": [per rank loader.state_dict()], "world_size": int,
     "spec": resolved spec, "manifest_sha256": str}

``model.pt`` (final weights): ``{"format", "kind": "model", "model", "model_config", "spec",
"manifest_sha256", "step", "tokens"}``.

``load_model(path, device)`` reads either and returns ``(model, info)``; ``info`` holds everything
but the weights.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lrattnres.io import atomic_torch_save

FORMAT = "lrattnres.train.checkpoint/1"


def model_config_dict(cfg: Any) -> dict:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, dict):
        return dict(cfg)
    raise TypeError(f"cannot record model config of type {type(cfg).__name__}")


def rng_state() -> dict:
    st = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(obj: dict, path: str | Path) -> None:
    obj = {"format": FORMAT, **obj}
    atomic_torch_save(obj, path)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{path}: not a lrattnres training checkpoint (expected format {FORMAT!r})")
    return obj


def _build(model_config: dict):
    from lrattnres.model import ModelConfig, build_model

    return build_model(ModelConfig(**model_config))


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, info)`` from a ``model.pt`` or ``checkpoint.pt``; the model is in eval mode."""
    obj = load(path, map_location="cpu")
    for key in ("model", "model_config"):
        if key not in obj:
            raise ValueError(f"{path}: checkpoint lacks {key!r}")
    model = _build(obj["model_config"])
    missing, unexpected = model.load_state_dict(obj["model"], strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not fit the recorded architecture (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model.to(device).eval()
    info = {k: v for k, v in obj.items() if k not in ("model", "optimizers", "rng", "loader")}
    info["path"] = str(path)
    return model, info
