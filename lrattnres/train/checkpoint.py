"""Checkpoints: the resumable training state, and the final weights later stages load.

Every file here is checked before it is used: its sha256 is recorded beside it when it is written
and compared when it is read. A file that fails the check (truncated, flipped bytes, replaced) is
refused with :class:`CheckpointError`, one line naming the file and what was expected, and never
loaded. Weights are safetensors; the rest of the training state is a torch file read with
``torch.load(weights_only=True)`` (tensors, numbers, strings and containers only: no pickled code).

Final weights, ``model.safetensors`` (a rule output) beside ``model.safetensors.sha256``
(``sha256sum`` format, so ``sha256sum -c model.safetensors.sha256`` checks it by hand)::

    safetensors tensors: the model's state_dict
    safetensors metadata: {"lrattnres": JSON {"format": MODEL_FORMAT, "kind": "model",
                           "model_config", "spec", "manifest_sha256", "step", "tokens", ...}}

Resumable state of a run folder (written atomically, periodically, on SIGTERM and at the end)::

    checkpoint.json                              {"format": FORMAT, "step", "tokens", "spec",
                                                  "model_config", "manifest_sha256", "code_sha256",
                                                  "world_size", "wall_s", "cpu_s", "train_s",
                                                  "files": {"model": {"file", "sha256", "bytes"},
                                                            "state": {"file", "sha256", "bytes"}}}
    checkpoint-<step>.model.safetensors           the weights at that step
    checkpoint-<step>.state.pt                    {"optimizers", "rng", "loader", "grad_norms"}

The step's files are written first, then ``checkpoint.json`` is renamed into place, then older
steps' files are removed: at every instant ``checkpoint.json`` names complete files whose hashes it
holds, so a kill at any point leaves the previous or the new checkpoint, never a mixture.

:func:`move_aside` moves a run's checkpoint (with the metrics and spec that go with it) into
``stale/<time>-step<k>/`` when a run starts over; nothing is deleted.

``load_model(path, device)`` reads final weights (``model.safetensors``), a resumable checkpoint
(``checkpoint.json``) or a run folder, and returns ``(model, info)``; ``info`` holds the metadata.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lrattnres.errors import UserError
from lrattnres.io import atomic_path, atomic_torch_save, atomic_write_json, atomic_write_text, sha256_file

FORMAT = "lrattnres.train.checkpoint/2"
MODEL_FORMAT = "lrattnres.model/1"
MODEL_FILE = "model.safetensors"
CHECKPOINT_FILE = "checkpoint.json"
STALE_DIR = "stale"
SHA_SUFFIX = ".sha256"
# Files an earlier layout wrote (pickles): never loaded, moved aside like a stale checkpoint.
LEGACY_FILES = ("checkpoint.pt",)
_META_KEY = "lrattnres"


class CheckpointError(UserError, ValueError):
    """A checkpoint or weights file that cannot be used; the message names the file."""


def model_config_dict(cfg: Any) -> dict:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, dict):
        return dict(cfg)
    raise TypeError(f"cannot record model config of type {type(cfg).__name__}")


# ---- RNG state in types that torch.load(weights_only=True) reads ------------------------------------


def rng_state() -> dict:
    """The RNG states of torch, numpy and Python as tensors, numbers and tuples (no numpy objects)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(_as_tuple(st["python"]))
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- checked files ------------------------------------------------------------------------------------


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + SHA_SUFFIX)


def _check_sha(path: Path, want: str | None, where: str) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: file missing (named by {where})")
    if not isinstance(want, str) or len(want) != 64:
        raise CheckpointError(f"{where}: no sha256 recorded for {path.name} (expected 64 hex digits, got {want!r})")
    got = sha256_file(path)
    if got != want:
        raise CheckpointError(
            f"{path}: sha256 {got[:16]}... differs from {want[:16]}... recorded in {where} "
            "(a truncated, corrupt or altered file); refusing to use it"
        )


def _read_sidecar(path: Path) -> str:
    side = _sidecar(path)
    try:
        text = side.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checksum file {side.name} beside it (expected '<sha256>  {path.name}'); "
                              "refusing an unchecked file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{side}: not readable ({e})") from None
    parts = text.split()
    if len(parts) != 2 or parts[1].lstrip("*") != path.name or len(parts[0]) != 64:
        raise CheckpointError(f"{side}: expected one line '<sha256>  {path.name}', got {text[:80]!r}")
    return parts[0].lower()


def _write_tensors(tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> str:
    """Write safetensors atomically; return the sha256 of the file as written."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
    return sha256_file(path)


def _read_tensors(path: Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        info = json.loads(meta.get(_META_KEY, "{}"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: metadata {_META_KEY!r} is not valid JSON ({e})") from None
    return tensors, info


# ---- final weights ------------------------------------------------------------------------------------


def save_model(state_dict: dict[str, torch.Tensor], meta: dict, path: str | Path) -> Path:
    """Write final weights to ``path`` (a .safetensors file) and its checksum beside it."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: weights are written as .safetensors")
    meta = {"format": MODEL_FORMAT, "kind": "model", **meta}
    side = _sidecar(path)
    side.unlink(missing_ok=True)  # never a checksum of other bytes beside new weights
    sha = _write_tensors(state_dict, meta, path)
    atomic_write_text(side, f"{sha}  {path.name}\n")
    return path


def read_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """Checked weights and metadata of a ``.safetensors`` file written by :func:`save_model`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    _check_sha(path, _read_sidecar(path), str(_sidecar(path)))
    tensors, meta = _read_tensors(path, device)
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"{path}: metadata field 'format' is {meta.get('format')!r}, expected {MODEL_FORMAT!r}")
    return tensors, meta


# ---- resumable checkpoints ----------------------------------------------------------------------------


def _step_name(step: int, part: str) -> str:
    return f"checkpoint-{step:08d}.{part}"


def save_checkpoint(out: str | Path, *, model_state: dict[str, torch.Tensor], state: dict, meta: dict) -> Path:
    """Write the resumable checkpoint of run folder ``out`` at ``meta["step"]`` (see the module doc)."""
    out = Path(out)
    step = int(meta["step"])
    mfile, sfile = out / _step_name(step, "model.safetensors"), out / _step_name(step, "state.pt")
    msha = _write_tensors(model_state, {"format": FORMAT, "kind": "checkpoint", "step": step}, mfile)
    atomic_torch_save(state, sfile)
    record = {"format": FORMAT, **meta, "files": {
        "model": {"file": mfile.name, "sha256": msha, "bytes": mfile.stat().st_size},
        "state": {"file": sfile.name, "sha256": sha256_file(sfile), "bytes": sfile.stat().st_size},
    }}
    atomic_write_json(out / CHECKPOINT_FILE, record)
    keep = {mfile.name, sfile.name}
    for old in out.glob("checkpoint-*"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return out / CHECKPOINT_FILE


def has_checkpoint(out: str | Path) -> bool:
    out = Path(out)
    return (out / CHECKPOINT_FILE).exists() or any((out / n).exists() for n in LEGACY_FILES)


def read_record(out: str | Path) -> dict | None:
    """The checked ``checkpoint.json`` of run folder ``out`` (its files' hashes verified), or None."""
    out = Path(out)
    path = out / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); refusing a corrupt checkpoint") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        got = rec.get("format") if isinstance(rec, dict) else type(rec).__name__
        raise CheckpointError(f"{path}: field 'format' is {got!r}, expected {FORMAT!r}")
    files = rec.get("files")
    for part in ("model", "state"):
        entry = files.get(part) if isinstance(files, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "/" in entry["file"]:
            raise CheckpointError(f"{path}: field 'files.{part}' missing or malformed (expected {{file, sha256}})")
        _check_sha(out / entry["file"], entry.get("sha256"), f"{path} (files.{part}.sha256)")
    for key in ("step", "spec", "model_config", "manifest_sha256", "world_size"):
        if key not in rec:
            raise CheckpointError(f"{path}: field {key!r} missing")
    return rec


def load_checkpoint(out: str | Path, record: dict | None = None) -> dict | None:
    """The whole resumable state of run folder ``out`` (checked), or None without a checkpoint:
    the record's fields plus ``model`` (state_dict) and the state file's ``optimizers``, ``rng``,
    ``loader`` and ``grad_norms``."""
    out = Path(out)
    rec = record if record is not None else read_record(out)
    if rec is None:
        return None
    model, _ = _read_tensors(out / rec["files"]["model"]["file"])
    spath = out / rec["files"]["state"]["file"]
    try:
        state = torch.load(spath, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable content is the same refusal
        raise CheckpointError(f"{spath}: not a readable training state ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(state, dict) or not {"optimizers", "rng", "loader", "grad_norms"} <= set(state):
        raise CheckpointError(f"{spath}: expected keys optimizers, rng, loader, grad_norms")
    return {**rec, "model": model, **state}


def move_aside(out: str | Path, reason: str, *, extra: tuple[str, ...] = ("metrics.jsonl", "spec.json")) -> Path | None:
    """Move run folder ``out``'s checkpoint files (and ``extra`` files of the same run) into
    ``out/stale/<UTC time>-step<k>/`` with a ``reason.txt``; returns that folder (None if nothing
    was there). The record is not read through its checks: a corrupt checkpoint moves aside too."""
    out = Path(out)
    names = [p.name for p in out.glob("checkpoint-*")] + [n for n in (CHECKPOINT_FILE, *LEGACY_FILES) if (out / n).exists()]
    if not names:
        return None
    step = "unknown"
    try:
        step = str(int(json.loads((out / CHECKPOINT_FILE).read_text(encoding="utf-8"))["step"]))
    except Exception:  # noqa: BLE001 - the step only names the folder
        pass
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest = out / STALE_DIR / f"{stamp}-step{step}"
    dest.mkdir(parents=True, exist_ok=False)
    for name in [*names, *(n for n in extra if (out / n).exists())]:
        shutil.move(str(out / name), str(dest / name))
    atomic_write_text(dest / "reason.txt", reason.rstrip("\n") + "\n")
    return dest


# ---- loading a model for later stages -----------------------------------------------------------------


def _build(model_config: dict, where: str):
    from lrattnres.model import ModelConfig, build_model

    try:
        return build_model(ModelConfig(**model_config))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: field 'model_config' does not describe a model ({e})") from None


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, info)`` from final weights (``model.safetensors``), a resumable checkpoint
    (``checkpoint.json``) or a run folder (its ``model.safetensors``); the model is in eval mode.
    Every file is checked against its recorded sha256 first."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if path.suffix == ".pt":
        raise CheckpointError(f"{path}: a pickle file is never loaded; expected {MODEL_FILE} (final weights) or "
                              f"{CHECKPOINT_FILE} (a training checkpoint)")
    if path.name == CHECKPOINT_FILE:
        rec = read_record(path.parent)
        tensors, _ = _read_tensors(path.parent / rec["files"]["model"]["file"])
        info = {k: v for k, v in rec.items() if k != "files"}
    else:
        tensors, info = read_model(path)
    if not isinstance(info.get("model_config"), dict):
        raise CheckpointError(f"{path}: metadata field 'model_config' missing")
    model = _build(info["model_config"], str(path))
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a shape that does not fit
        raise CheckpointError(f"{path}: weights do not fit the recorded architecture ({str(e).splitlines()[-1].strip()})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not fit the recorded architecture (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model.to(device).eval()
    info = dict(info)
    info["path"] = str(path)
    return model, info
