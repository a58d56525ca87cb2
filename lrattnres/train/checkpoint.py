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

Resumable state of a run folder (written atomically, periodically, on SIGTERM and at the end), by
every rank of a data-parallel run at once, each its share::

    checkpoint.json                              {"format": FORMAT, "step", "tokens", "spec",
                                                  "model_config", "manifest_sha256", "code_sha256",
                                                  "code_files" ({path: sha256} of the training code),
                                                  "commit", "code_changes", "world_size", "wall_s",
                                                  "cpu_s", "train_s",
                                                  "files": {"tensors": [{"rank", "file", "sha256", "bytes"}, ...],
                                                            "state": [{"rank", "file", "sha256", "bytes"}, ...]}}
    checkpoint-<step>-<token>.r<rank>.safetensors  the rank's share of the tensors: "model.<name>" (the
                                                  weights it owns) and "optim.<optimiser>.<name>.<key>"
                                                  (their optimiser state: Muon's momentum, AdamW's moments)
    checkpoint-<step>-<token>.r<rank>.state.pt     {"rng", "loader", "grad_norms"} of that rank

A rank owns the parameters ZeroRedundancyOptimizer's partition gives it (lrattnres/train/optim.py,
``owners``), sharded or not, so each writes about 1/world of the bytes and hashes them itself; the
state is kept by parameter name, so a run resumes with its optimiser state sharded or not. The
step's files are written first (under a token no earlier write used), then ``checkpoint.json`` is
renamed into place by rank 0, then older steps' files are removed: at every instant
``checkpoint.json`` names complete files whose hashes it holds, so a kill at any point leaves the
previous or the new checkpoint, never a mixture. On resume the ranks hash the files side by side
(:func:`verify_files`).

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
from lrattnres.model import ModelConfig, build_model

FORMAT = "lrattnres.train.checkpoint/3"
FORMAT_V2 = "lrattnres.train.checkpoint/2"  # one weights file and one state file: read, never resumed
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

MODEL_PREFIX, OPTIM_PREFIX = "model.", "optim."


def _step_name(step: int, token: str, rank: int, part: str) -> str:
    return f"checkpoint-{step:08d}-{token}.r{rank:05d}.{part}"


def _gather(obj, world: int) -> list:
    if world <= 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def save_checkpoint(out: str | Path, *, tensors: dict[str, torch.Tensor], state: dict, meta: dict,
                    rank: int = 0, world: int = 1) -> Path:
    """Write this rank's part of the resumable checkpoint of run folder ``out`` at ``meta["step"]``
    (every rank of a data-parallel run calls it at once; see the module doc).

    ``tensors``: this rank's share (``model.<name>``, ``optim.<optimiser>.<name>.<key>``), written as
    safetensors; ``state``: its RNG and data-loader state (and rank 0's gradient-norm history). Each
    rank hashes its own files; rank 0 then writes ``checkpoint.json`` naming every rank's files with
    their sha256 and removes older steps' files. The ranks write side by side, so the time to save
    is that of the largest share, not of the whole state."""
    import secrets

    out = Path(out)
    step = int(meta["step"])
    token = _gather(secrets.token_hex(4), world)[0]  # rank 0's: file names no earlier write used
    tfile, sfile = out / _step_name(step, token, rank, "safetensors"), out / _step_name(step, token, rank, "state.pt")
    tsha = _write_tensors(tensors, {"format": FORMAT, "kind": "checkpoint", "step": step, "rank": rank}, tfile)
    atomic_torch_save(state, sfile)
    mine = [{"part": "tensors", "rank": rank, "file": tfile.name, "sha256": tsha, "bytes": tfile.stat().st_size},
            {"part": "state", "rank": rank, "file": sfile.name, "sha256": sha256_file(sfile), "bytes": sfile.stat().st_size}]
    entries = [e for part in _gather(mine, world) for e in part]
    path = out / CHECKPOINT_FILE
    if rank == 0:
        files = {part: sorted((e for e in entries if e["part"] == part), key=lambda e: e["rank"])
                 for part in ("tensors", "state")}
        record = {"format": FORMAT, **meta, "files": {k: [{x: e[x] for x in ("rank", "file", "sha256", "bytes")}
                                                          for e in v] for k, v in files.items()}}
        atomic_write_json(path, record)
        keep = {e["file"] for e in entries}
        for old in out.glob("checkpoint-*"):
            if old.name not in keep:
                old.unlink(missing_ok=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # nobody goes on before the record names the new files
    return path


def has_checkpoint(out: str | Path) -> bool:
    out = Path(out)
    return (out / CHECKPOINT_FILE).exists() or any((out / n).exists() for n in LEGACY_FILES)


def _entries(rec: dict) -> list[tuple[str, dict]]:
    return [(part, e) for part in ("tensors", "state") for e in rec["files"][part]]


def read_record(out: str | Path, *, verify: bool | tuple[int, int] = True) -> dict | None:
    """The ``checkpoint.json`` of run folder ``out``, or None; its fields and file list are checked,
    and its files' sha256: all of them (``verify=True``), none (False), or ``(rank, world)``: the
    share of one rank of a data-parallel run (every ``world``-th file), so that the ranks hash side by
    side (:func:`verify_files` then gathers their findings)."""
    out = Path(out)
    path = out / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); refusing a corrupt checkpoint") from None
    if not isinstance(rec, dict) or rec.get("format") not in (FORMAT, FORMAT_V2):
        got = rec.get("format") if isinstance(rec, dict) else type(rec).__name__
        raise CheckpointError(f"{path}: field 'format' is {got!r}, expected {FORMAT!r}")
    files = rec.get("files")
    if rec["format"] == FORMAT_V2:  # one weights file and one state file, written by rank 0
        rec["files"] = files = {"tensors": [dict(files.get("model") or {}, rank=0)] if isinstance(files, dict) else None,
                                "state": [dict(files.get("state") or {}, rank=0)] if isinstance(files, dict) else None}
    for part in ("tensors", "state"):
        entries = files.get(part) if isinstance(files, dict) else None
        if not isinstance(entries, list) or not entries or not all(
                isinstance(e, dict) and isinstance(e.get("file"), str) and "/" not in e["file"] for e in entries):
            raise CheckpointError(f"{path}: field 'files.{part}' missing or malformed (expected a list of {{rank, file, sha256}})")
    for key in ("step", "spec", "model_config", "manifest_sha256", "world_size"):
        if key not in rec:
            raise CheckpointError(f"{path}: field {key!r} missing")
    if verify:
        rank, world = verify if isinstance(verify, tuple) else (0, 1)
        for i, (part, e) in enumerate(_entries(rec)):
            if i % world == rank:
                _check_sha(out / e["file"], e.get("sha256"), f"{path} (files.{part}[{e.get('rank')}].sha256)")
    return rec


def verify_files(out: str | Path, rank: int = 0, world: int = 1) -> dict | None:
    """:func:`read_record` with the files hashed by all ranks of a run side by side: every rank raises
    the same :class:`CheckpointError` (the first rank's that found one) if any file fails."""
    err, rec = None, None
    try:
        rec = read_record(out, verify=(rank, world))
    except CheckpointError as e:
        err = str(e)
    errors = [e for e in _gather(err, world) if e]
    if errors:
        raise CheckpointError(errors[0])
    return rec


def _tensor_files(out: Path, rec: dict):
    from safetensors import SafetensorError, safe_open

    for e in rec["files"]["tensors"]:
        path = out / e["file"]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield path, f
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None


def read_tensors(out: str | Path, rec: dict, prefix: str = MODEL_PREFIX, want=None) -> dict[str, torch.Tensor]:
    """The tensors of every rank's file whose name starts with ``prefix`` (and, given ``want``, whose
    name without it ``want`` accepts), keyed without the prefix; each read from disk only if taken."""
    out, got = Path(out), {}
    for _, f in _tensor_files(out, rec):
        for k in f.keys():
            name = k if rec["format"] != FORMAT_V2 else MODEL_PREFIX + k
            if name.startswith(prefix) and (want is None or want(name[len(prefix):])):
                got[name[len(prefix):]] = f.get_tensor(k)
    return got


def read_state(out: str | Path, rec: dict, rank: int) -> dict:
    """The small state (RNG, data loader, gradient norms) rank ``rank`` wrote."""
    out = Path(out)
    entry = next((e for e in rec["files"]["state"] if e.get("rank") == rank), None)
    if entry is None:
        raise CheckpointError(f"{out / CHECKPOINT_FILE}: no state file of rank {rank}")
    spath = out / entry["file"]
    try:
        state = torch.load(spath, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable content is the same refusal
        raise CheckpointError(f"{spath}: not a readable training state ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    want = {"rng", "loader", "grad_norms"}
    if not isinstance(state, dict) or not want <= set(state):
        raise CheckpointError(f"{spath}: expected keys {', '.join(sorted(want))}")
    return state


def training_tensors(model: torch.nn.Module, optimizers: dict, owner: dict[str, int], rank: int) -> dict[str, torch.Tensor]:
    """This rank's share of the resumable tensors: the weights it owns and their optimiser state
    (``optimizers``: the local optimisers, which hold the state this rank keeps)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {MODEL_PREFIX + n: t.detach() for n, t in model.state_dict().items() if owner.get(n, 0) == rank}
    for oname, opt in optimizers.items():
        for p, st in opt.state.items():
            n = names[id(p)]
            if owner.get(n, 0) != rank:
                continue
            for key, v in st.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"optimiser {oname!r} keeps a non-tensor state {key!r} for {n}: not checkpointable")
                out[f"{OPTIM_PREFIX}{oname}.{n}.{key}"] = v.detach()
    return out


def restore_training(out: str | Path, rec: dict, model: torch.nn.Module, optimizers: dict) -> None:
    """Load every weight into ``model`` and, into each local optimiser, the state of its parameters,
    from whichever rank's file holds them (a run resumes with its optimiser state sharded or not,
    whichever way it was written)."""
    out = Path(out)
    weights = read_tensors(out, rec, MODEL_PREFIX)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{out / CHECKPOINT_FILE}: weights do not fit the model (missing {sorted(missing)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]})")
    del weights
    names = {id(p): n for n, p in model.named_parameters()}
    for oname, opt in optimizers.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        mine = {names[id(p)] for p in params}
        flat = read_tensors(out, rec, f"{OPTIM_PREFIX}{oname}.", want=lambda k: k.rsplit(".", 1)[0] in mine)
        state: dict[int, dict[str, torch.Tensor]] = {}
        index = {names[id(p)]: i for i, p in enumerate(params)}
        for k, v in flat.items():
            pname, key = k.rsplit(".", 1)
            state.setdefault(index[pname], {})[key] = v
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)


def load_checkpoint(out: str | Path, record: dict | None = None) -> dict | None:
    """The whole resumable state of run folder ``out`` (checked), or None without a checkpoint: the
    record's fields plus ``model`` (state_dict), ``optimizers`` ({optimiser: {parameter: {key:
    tensor}}}) and per rank lists ``rng`` and ``loader``, and ``grad_norms``."""
    out = Path(out)
    rec = record if record is not None else read_record(out)
    if rec is None:
        return None
    optim: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for k, v in read_tensors(out, rec, OPTIM_PREFIX).items():
        oname, rest = k.split(".", 1)
        pname, key = rest.rsplit(".", 1)
        optim.setdefault(oname, {}).setdefault(pname, {})[key] = v
    states = [read_state(out, rec, e["rank"]) for e in rec["files"]["state"]]
    return {**rec, "model": read_tensors(out, rec, MODEL_PREFIX), "optimizers": optim,
            "rng": [s["rng"] for s in states], "loader": [s["loader"] for s in states],
            "grad_norms": states[0]["grad_norms"]}


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
        tensors = read_tensors(path.parent, rec, MODEL_PREFIX)
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
