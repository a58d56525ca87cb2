"""A scale run in pieces that continue each other, on machines that keep nothing between them.

A GPU machine lent for a few minutes at a time cannot hold a whole scale: its disk is gone after each
command, and only small files come back. A *piece* is a group of training runs together with every
stage that needs their weights (routing diagnostics, conversion, downstream evaluation, Appendix I's
check of every routing read of the size pair), so the weights never have to leave the machine. The
scale's ``pieces`` list names the groups by run-id patterns; a run belongs to the first piece that
matches it.

A piece may also hold no runs, only stages (``stages: [throughput]``, optionally ``presets``: the
sizes it times). The throughput stage keeps its finished timed runs in a partial state beside its
output; a piece run with ``--deadline`` passes ``LRATTNRES_DEADLINE`` to its jobs, so the stage stops
before the piece's time is up, and running the same piece again, restoring its last archive,
continues it until the result is complete.

``python -m lrattnres piece list`` shows the pieces and their jobs.
``python -m lrattnres piece run NAME --out DIR [--restore A.tar.xz ...] [--deadline S]`` checks every
archive whole before anything runs (lrattnres/piece_archive.py: data only), rebuilds the data (the
manifest is deterministic, so restored results still match it), restores the archives (the newest
copy of a file wins), checks that the restored results belong to the scale, runs the piece's
unfinished work through Snakemake, and writes ``DIR/<name>.tar.xz``: the piece's own small outputs
(results, curves, logs, stage JSONs, with the scale's settings and data manifest) and their Snakemake
metadata, and ``DIR/<name>.json``: what ran, how long, at what throughput, in this invocation and in
all of the piece's invocations together (the records beside the restored archives carry the earlier
ones). Exit status: 0 complete; 1 a job failed (see ``DIR/<name>.log``); 2 refused (a bad archive,
other data or settings, a bad argument); 75 stopped by its deadline or a signal, what finished packed.
``python -m lrattnres piece report --restore ... --into reports/recorded/<name>`` renders the report
from restored pieces on any machine (no GPU, no weights) and records it.

Finished work is never redone. A run whose outputs in the piece all exist (restored, or made earlier
on the same machine) is left out of Snakemake's targets, and the piece says which it skips; weights
never travel, so a restored result whose later outputs are missing could only be made whole by
training the run again, which the piece refuses unless ``--allow-rerun``. A job that a killed
Snakemake left marked incomplete, although its outputs are whole (every stage writes atomically, the
trainer its result last), is marked complete first.

Interrupts keep what finished. SIGTERM, SIGINT or SIGHUP to the piece, or its deadline, stops
Snakemake's whole process group (lrattnres/process_group.py) and waits until none of its jobs is
left; then the piece packs what is complete (the runs whose outputs all exist, stage outputs, the
timing stage's partial state, logs), records itself as partial and exits 75. Running it again,
restoring that archive, continues.

Continuing across machines and across commits: a restored output is never redone by Snakemake; instead
the restored results must have been made on the same data manifest (sha256) and with the same science
settings (every run's training spec, and the scale's presets, recipe, data, grid and stage settings,
the throughput timing and the accounting included) as the current configuration, or the piece
refuses. A change of code alone does not redo a restored run; the recorded report lists every commit
its pieces ran at.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattnres import process_group
from lrattnres.attempts import EX_TEMPFAIL, read_status
from lrattnres.config import ConfigError, load_and_resolve, science
from lrattnres.data.manifest import sha256_file
from lrattnres.deadline import ENV as DEADLINE_ENV
from lrattnres.gridplan import conversions, evaluations, plan, train_spec
from lrattnres.io import atomic_path, atomic_write_json, read_json
from lrattnres.piece_archive import (KEEP, ArchiveError, kept, metadata_name, pack, read_archive,  # noqa: F401
                                     read_archives, restore, restore_members, small_outputs)
from lrattnres.provenance import now, provenance
from lrattnres.train import spec as spec_mod

STAGES = ("settings", "accounting", "kernel_check", "throughput")
# The rules a stage of a piece may run (the throughput stage: one job per size, then the merge).
STAGE_RULES = {"throughput": ("throughput_size", "throughput")}
# The rules that render the report from the pieces' small outputs (no weights needed).
REPORT_RULES = ("grid_summary", "convert_all", "diagnostics", "evaluate_pairs", "throughput", "kernel_check_trained",
                "report")
# A piece's deadline (--deadline, seconds) is shared out from its end backwards: its jobs' own
# LRATTNRES_DEADLINE (lrattnres/deadline.py) falls PACK_MARGIN_S before it, so that a stage that can
# stop early (throughput) keeps its partial state and exits by itself; STOP_MARGIN_S before it the
# piece stops what still runs (SIGTERM to Snakemake's process group, SIGKILL STOP_GRACE_S later); the
# rest is for packing. A deadline under MIN_DEADLINE_S leaves the jobs no time and is refused.
PACK_MARGIN_S = 45
STOP_MARGIN_S = 30
STOP_GRACE_S = 15
MIN_DEADLINE_S = 60
# Exit status of a piece stopped by its deadline or a signal, with what finished packed (EX_TEMPFAIL).
EXIT_STOPPED = EX_TEMPFAIL
# How a piece starts Snakemake (tests put a stand-in here).
SNAKEMAKE = (sys.executable, "-m", "snakemake")
# The train rule's outputs in a run folder (workflow/rules/train.smk); the trainer writes result.json last.
TRAIN_OUTPUTS = ("result.json", "model.safetensors", "model.safetensors.sha256")
# Snakemake's rerun triggers while continuing: none of code, modification times, parameters or input
# lists (any edit of a stage's modules changes its code param, and would redo every restored run). What decides whether a
# restored result still belongs to the scale is checked here instead: the same data manifest and the
# same science settings (check_same_data, check_same_settings).
CONTINUE_TRIGGERS = ("software-env",)
# Trainings side by side on one GPU (the scale's resources.train.jobs_per_gpu > 1): the routing kernel's eager autotuner (used by validation and the later
# stages, not by compiled training) failed with "misaligned address" when seven training processes
# reached their first validation together on one H200; its first candidate configuration runs.
SHARED_GPU_ENV = {"KERNELS_AUTOTUNE": "0"}
# Keys of a run's training spec that say how a run reports and saves itself, not what it computes.
TRAIN_EXECUTION_KEYS = ("log_every_s", "checkpoint", "grad_guard")
# Sections of the resolved settings that decide what a restored output holds.
SCIENCE_SECTIONS = ("presets", "recipe", "data", "train", "grid", "convert", "evaluate", "diagnostics",
                    "kernel_check", "throughput", "accounting")


class PieceError(ValueError):
    """A piece that cannot run as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Piece:
    name: str
    runs: tuple[str, ...]
    stages: tuple[str, ...]
    presets: tuple[str, ...] = ()  # the throughput sizes a piece times (empty: all of the scale's)


def plan_pieces(settings: dict) -> list[Piece]:
    """The scale's pieces, each with its runs (first matching piece wins) and extra stages.

    Without a ``pieces`` setting the scale is one piece. Runs that no piece matches are an error."""
    run_ids = [r.run_id for r in plan(settings)]
    spec = settings.get("pieces") or [{"name": "all", "runs": ["*"], "stages": list(STAGES)}]
    taken: set[str] = set()
    out = []
    timed = list(settings.get("throughput", {}).get("presets", []))
    for p in spec:
        runs = [r for r in run_ids if r not in taken and any(fnmatch.fnmatchcase(r, pat) for pat in p.get("runs", []))]
        taken.update(runs)
        presets = tuple(p.get("presets", ()))
        if set(presets) - set(timed):
            raise PieceError(f"pieces: piece {p['name']!r} times presets {sorted(set(presets) - set(timed))}, which the "
                             f"scale's throughput does not (throughput.presets: {timed})")
        if not p.get("runs") and not p.get("stages"):
            raise PieceError(f"pieces: piece {p['name']!r} has neither runs nor stages")
        out.append(Piece(p["name"], tuple(runs), tuple(p.get("stages", ())), presets))
    left = [r for r in run_ids if r not in taken]
    if left:
        raise PieceError(f"pieces: runs {left} match no piece's patterns (add a pattern, e.g. '*', to the last)")
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise PieceError(f"pieces: duplicate piece names in {names}")
    return out


def stage_targets(settings: dict, piece: Piece) -> list[str]:
    """The files a piece's stages make."""
    R = settings["results"]
    out = []
    for s in piece.stages:
        if s == "throughput" and piece.presets:  # some sizes: their own results, merged at the report
            out += [f"{R}/throughput/{p}.json" for p in piece.presets]
        else:
            out.append(f"{R}/{s}.json")
    return out


def run_targets(settings: dict, run: str) -> list[str]:
    """The files a piece makes of one run: its result, diagnostics, conversion and evaluation, and for
    the size pair's runs Appendix I's check of every routing read."""
    R = settings["results"]
    out = [f"{R}/runs/{run}/result.json", f"{R}/diagnostics/{run}.json"]
    if run in {c["run_id"] for c in conversions(settings)}:
        out.append(f"{R}/convert/{run}.json")
    if run in {e["run_id"] for e in evaluations(settings)}:  # the size pair's runs
        out += [f"{R}/evaluate/{run}.json", f"{R}/kernel_check/{run}.json"]
    return out


def piece_targets(settings: dict, piece: Piece) -> list[str]:
    """The files a piece makes: its stages' outputs, then every run's (:func:`run_targets`)."""
    return stage_targets(settings, piece) + [t for run in piece.runs for t in run_targets(settings, run)]


def finished_runs(settings: dict, piece: Piece, workdir: str = ".") -> list[str]:
    """The piece's runs whose every output exists: they are never trained again."""
    return [run for run in piece.runs if all((Path(workdir) / t).is_file() for t in run_targets(settings, run))]


# ------------------------------------------------------------------------ what a piece owns


def _log_of(results: str, target: str) -> str:
    """The log of the job that makes ``target``: ``<results>/logs/<path>.log`` for ``<results>/<path>.json``
    (runs/<run>/result.json: logs/train/<run>.log), as the rules name them (workflow/rules/*.smk)."""
    rel = target[len(results) + 1:]
    parts = rel.split("/")
    if len(parts) == 3 and parts[0] == "runs" and parts[2] == "result.json":
        return f"{results}/logs/train/{parts[1]}.log"
    return f"{results}/logs/{rel.removesuffix('.json')}.log"


def _with_attempts(log: str, workdir: Path) -> list[str]:
    """A job's log and what lrattnres/attempts.py keeps beside it (each attempt's log, the status)."""
    folder, stem = log.rsplit("/", 1)
    stem = stem.removesuffix(".log")
    return [log] + sorted(p.relative_to(workdir).as_posix() for p in (workdir / folder / "attempts").glob(f"{stem}.*"))


def own_files(settings: dict, piece: Piece, workdir: str = ".") -> list[str]:
    """The existing files a piece brings back: its own outputs, complete ones only (a run's files only
    when every output of the run exists, since its weights stay behind), the logs of its jobs, and the
    scale's settings and data manifest they were made with. Outputs restored from other pieces are
    not its own (an older copy must never travel on and replace a newer one)."""
    cwd = Path(workdir)
    R = settings["results"]
    files = [f"{R}/settings.json", f"{R}/data/manifest.json", f"{R}/data/build.json"]
    files += _with_attempts(f"{R}/logs/prepare_data.log", cwd) + _with_attempts(f"{R}/logs/corpus_pack.log", cwd)
    timed = list(settings.get("throughput", {}).get("presets", []))
    for t in stage_targets(settings, piece):
        files += [t, *_with_attempts(_log_of(R, t), cwd)]
        if t == f"{R}/throughput.json":  # the whole stage: every size and the merge
            sizes = [f"{R}/throughput/{p}.json" for p in timed]
        elif t.startswith(f"{R}/throughput/"):
            sizes = [t]
        else:
            sizes = []
        for size in sizes:
            files += [size, size.removesuffix(".json") + ".partial.json", *_with_attempts(_log_of(R, size), cwd)]
    done = set(finished_runs(settings, piece, workdir))
    for run in piece.runs:
        targets = run_targets(settings, run)
        for t in targets:
            files += _with_attempts(_log_of(R, t), cwd)
        if run in done:
            files += targets + [f"{R}/runs/{run}/metrics.jsonl", f"{R}/runs/{run}/spec.json"]
    out = []
    for f in dict.fromkeys(files):
        if f.startswith(R + "/") and kept(f[len(R) + 1:]) and (cwd / f).is_file():
            out.append(f)
    return out


def _incomplete_marker(workdir: Path, path: str) -> Path:
    """Snakemake's mark of an output whose job has not finished (.snakemake/incomplete/<base64>, split
    into folders of 254 characters as Snakemake's file persistence does)."""
    b64 = metadata_name(path)
    chunks = [b64[i: i + 254] for i in range(0, len(b64), 254)]
    return workdir.joinpath(".snakemake", "incomplete", *("@" + c for c in chunks[:-1]), chunks[-1])


def _whole_json(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False


def complete_finished(settings: dict, piece: Piece, workdir: str = ".") -> list[str]:
    """Clear Snakemake's incomplete marks on the piece's outputs that are whole, so that a job killed
    after its work was written (SIGKILL to Snakemake, a lost machine) is not done again. Every stage
    writes its output atomically, and the trainer writes result.json after the weights; a train job's
    outputs count as whole when all exist and result.json is a JSON object. Returns the outputs."""
    cwd = Path(workdir)
    R = settings["results"]
    if not (cwd / ".snakemake" / "incomplete").is_dir():
        return []
    groups = [[t] for t in stage_targets(settings, piece)]
    for run in piece.runs:
        groups.append([f"{R}/runs/{run}/{f}" for f in TRAIN_OUTPUTS])
        groups += [[t] for t in run_targets(settings, run)[1:]]
    cleared = []
    for outputs in groups:
        marks = [_incomplete_marker(cwd, o) for o in outputs]
        if not any(m.is_file() for m in marks):
            continue
        if all((cwd / o).is_file() for o in outputs) and _whole_json(cwd / outputs[0]):
            for m in marks:
                m.unlink(missing_ok=True)
            cleared += outputs
    return cleared


# ------------------------------------------------------------------------ checking restored results


def check_same_data(results: str) -> int:
    """Every restored training result was trained on the current data manifest; returns how many."""
    manifest = Path(results) / "data" / "manifest.json"
    if not manifest.is_file():
        raise PieceError(f"{manifest}: missing (build the data first)")
    want = sha256_file(manifest)
    n = 0
    for spec in sorted(Path(results).glob("runs/*/spec.json")):
        got = read_json(spec).get("manifest_sha256")
        if got != want:
            raise PieceError(f"{spec}: trained on data manifest {str(got)[:12]}..., the current one is {want[:12]}... "
                             "(the data changed since that piece: start the scale afresh, or restore the "
                             "pieces of this data only)")
        n += 1
    return n


def check_same_settings(settings: dict, results: str, accept: tuple[str, ...] = ()) -> list[str]:
    """The restored scale's science settings (:data:`SCIENCE_SECTIONS`) and every restored run's
    training spec equal the current ones, but for the dotted keys in ``accept`` (differences an
    operator has judged not to change the results, e.g. a new key whose default is the old
    behaviour); returns the sections compared. Raises naming the first difference."""
    def differs(old, new, section: str = "") -> list[str]:
        """Keys that differ and are not accepted (as ``key`` or, in a section, ``section.key``)."""
        keys = spec_mod.diff_keys(old if isinstance(old, dict) else {"": old},
                                  new if isinstance(new, dict) else {"": new}, ignore=())
        names = {k: [k] + ([f"{section}.{k}" if k else section] if section else []) for k in keys}
        return [k or section for k in keys
                if not any(n == a or n.startswith(a + ".") for n in names[k] for a in accept)]

    saved_path = Path(results) / "settings.json"
    if not saved_path.is_file():
        raise PieceError(f"{saved_path}: missing (the first piece writes it: restore its archive too)")
    saved = read_json(saved_path)
    current = science(settings)  # settings.json leaves out the execution settings: compare like with like
    compared = []
    for key in SCIENCE_SECTIONS:
        if key in saved or key in current:
            keys = differs(saved.get(key), current.get(key), key)
            if keys:
                raise PieceError(f"{saved_path}: settings.{key} differs from the current configuration in "
                                 f"{keys} (the restored pieces belong to another experiment; --accept KEY "
                                 "takes a difference that changes no result)")
            compared.append(key)
    runs = {r.run_id: r for r in plan(settings)}
    for path in sorted(Path(results).glob("runs/*/spec.json")):
        run_id = path.parent.name
        if run_id not in runs:
            raise PieceError(f"{path}: run {run_id} is not part of the current grid")
        want = spec_mod.resolve(train_spec(settings, runs[run_id]))
        keys = [k for k in differs(read_json(path).get("spec") or {}, want)
                if k.split(".")[0] not in TRAIN_EXECUTION_KEYS]
        if keys:
            raise PieceError(f"{path}: the run's training spec differs from the current one in {keys}")
    return compared


# --------------------------------------------------------------------------------- running


def _snakemake(args: list[str], log, *, stop: process_group.StopRequest | None = None, stop_at: float | None = None,
               env: dict | None = None) -> process_group.Outcome:
    """Snakemake in a process group of its own, stopped whole when ``stop`` is asked or at ``stop_at``."""
    cmd = [*SNAKEMAKE, *args]
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    out = process_group.run(cmd, stdout=log, env={**os.environ, **(env or {})}, stop=stop, stop_at=stop_at,
                            grace_s=STOP_GRACE_S)
    if out.stopped:
        log.write(f"[piece] snakemake stopped ({out.stopped}), exit {out.returncode}"
                  + (f"; killed after {STOP_GRACE_S} s: {out.killed}" if out.killed else "") + "\n")
        log.flush()
    return out


def planned_jobs(targets: list[str], config_args: list[str], extra: list[str]) -> dict[str, int]:
    """Snakemake's dry-run job counts (rule -> count) for ``targets``."""
    cmd = [*SNAKEMAKE, *targets, "-n", "--quiet", "rules", *extra,
           "--rerun-triggers", *CONTINUE_TRIGGERS, "--config", *config_args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise PieceError(f"snakemake dry run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    counts: dict[str, int] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("job", "total"):
            counts[parts[0]] = int(parts[1])
    return counts


def _result_times(results: str, runs: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for run in runs:
        path = Path(results) / "runs" / run / "result.json"
        if path.is_file():
            out[run] = path.stat().st_mtime
    return out


def _run_summaries(results: str, runs: tuple[str, ...], trained: set[str]) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        path = Path(results) / "runs" / run / "result.json"
        if not path.is_file():
            out.append({"run_id": run, "done": False})
            continue
        r = read_json(path)
        out.append({"run_id": run, "done": True, "trained_here": run in trained, "final_val_ce": r.get("final_val_ce"),
                    "final_train_ce": r.get("final_train_ce"), "data_epochs": r.get("data_epochs"),
                    "tokens": r.get("tokens"), "wall_s": r.get("wall_s"), "train_s": r.get("train_s"),
                    "tokens_per_s": r.get("tokens_per_s"), "steady_tokens_per_s": r.get("steady_tokens_per_s")})
    return out


def _stopped_at_deadline(results: str, missing: list[str], since: float) -> bool:
    """Whether a job of a missing output stopped at its deadline (exit 75) in this invocation."""
    for t in missing:
        log = _log_of(results, t)
        rec = read_status(log)
        status = Path(log).parent / "attempts" / f"{Path(log).stem}.status.json"
        if rec and rec.get("code") == EX_TEMPFAIL and status.stat().st_mtime >= since:
            return True
    return False


def _invocation(record: dict[str, Any]) -> dict[str, Any]:
    """The cost of one invocation of a piece, from its record."""
    prov = record.get("provenance") or {}
    return {"started": prov.get("started"), "wall_s": record.get("wall_s"), "run_s": record.get("run_s"),
            "trained_runs": len(record.get("trained_runs") or []) if "trained_runs" in record else None,
            "trained_tokens": record.get("trained_tokens"), "stopped": record.get("stopped"),
            "commit": prov.get("commit"), "device": prov.get("device")}


def _record_beside(archive: str) -> Path | None:
    return Path(archive[: -len(".tar.xz")] + ".json") if archive.endswith(".tar.xz") else None


def earlier_invocations(archives: list[str], name: str) -> list[dict[str, Any]]:
    """The invocations of piece ``name`` recorded beside the restored archives (``<name>.json`` next to
    ``<name>.tar.xz``), oldest first, each once."""
    seen: dict[Any, dict] = {}
    for arc in archives:
        path = _record_beside(str(arc))
        if path is None or not path.is_file():
            continue
        try:
            rec = read_json(path)
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or rec.get("piece") != name:
            continue
        for inv in rec.get("invocations") or [_invocation(rec)]:
            if isinstance(inv, dict):
                seen.setdefault((inv.get("started"), inv.get("wall_s")), inv)
    return sorted(seen.values(), key=lambda inv: str(inv.get("started")))


def run_piece(settings: dict, name: str, out: str, *, restore_from: list[str], config_args: list[str],
              cores: str, deadline_s: float | None, allow_rerun: bool,
              extra: list[str], accept: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run piece ``name`` (see the module docstring); returns its record, whose ``exit_code`` is the
    command's exit status (0, 1 or 75; a refusal raises :class:`PieceError` before anything is packed)."""
    pieces = {p.name: p for p in plan_pieces(settings)}
    if name not in pieces:
        raise PieceError(f"no piece {name!r}; the scale's pieces are {list(pieces)}")
    if deadline_s is not None and deadline_s < MIN_DEADLINE_S:
        raise PieceError(f"--deadline {deadline_s:g}: a piece needs at least {MIN_DEADLINE_S} s (its jobs stop "
                         f"{PACK_MARGIN_S} s before the deadline, to leave time for stopping them and packing)")
    started, t0, since = now(), time.monotonic(), time.time()
    try:  # every archive is checked whole before anything runs or is written
        archives = read_archives(restore_from, settings["results"])
    except ArchiveError as e:
        raise PieceError(str(e)) from None
    earlier = earlier_invocations(restore_from, name)  # read before this invocation's record replaces one
    Path(out).mkdir(parents=True, exist_ok=True)
    with process_group.StopRequest() as stop, open(Path(out) / f"{name}.log", "a", encoding="utf-8") as log:
        job = _PieceRun(settings, pieces[name], out, restore_from, config_args, cores, deadline_s, extra, log, stop, t0)
        job.build_data()  # 1. the data, built here (deterministic: the same bytes as where earlier pieces ran)
        job.restore(archives, accept)  # 2. earlier pieces, then the checks that they belong to this scale
        todo, pending = job.plan(allow_rerun)  # 3. what has finished is not done again
        trained = job.run_jobs(todo, pending)  # 4. the piece
        job.conclude(since)
        job.pack(trained, started, earlier, t0)  # 5. the record and the archive
    return job.record


class _PieceRun:
    """One invocation of a piece: its Snakemake arguments, its log, what it has stopped for, and the
    record it builds (``record``)."""

    def __init__(self, settings: dict, piece: Piece, out: str, restore_from: list[str], config_args: list[str],
                 cores: str, deadline_s: float | None, extra: list[str], log, stop: process_group.StopRequest,
                 t0: float):
        self.settings, self.piece, self.name, self.out = settings, piece, piece.name, out
        self.R = settings["results"]
        self.config_args, self.log, self.stop = config_args, log, stop
        self.logs = Path(out) / f"{piece.name}.log"
        self.end = None if deadline_s is None else t0 + deadline_s
        self.stop_at = None if self.end is None else self.end - STOP_MARGIN_S
        self.smk = [*extra, "--cores", cores, "--scheduler", "greedy", "--keep-going", "--nolock"]
        self.sharing = int(settings.get("resources", {}).get("train", {}).get("jobs_per_gpu", 1))
        self.record: dict[str, Any] = {
            "piece": piece.name, "scale": settings.get("scale"), "runs": list(piece.runs),
            "stages": list(piece.stages), "train_jobs_per_gpu": self.sharing, "restored_from": restore_from,
            "deadline_s": deadline_s,
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith(("KERNELS_", "LRATTNRES_", "TRITON_", "TORCH"))}}
        self.stopped: str | None = None
        self.targets = piece_targets(settings, piece)
        self.finished: list[str] = []
        self.missing: list[str] = []

    def say(self, msg: str) -> None:
        self.log.write(msg + "\n")
        self.log.flush()
        print(msg, file=sys.stderr, flush=True)

    def build_data(self) -> None:
        t = time.monotonic()
        manifest = f"{self.R}/data/manifest.json"
        built = _snakemake([manifest, *self.smk, "--config", *self.config_args], self.log, stop=self.stop,
                           stop_at=self.stop_at)
        self.stopped = built.stopped
        if self.stopped is None and built.returncode != 0:
            raise PieceError(f"building the data failed (exit {built.returncode}); see {self.logs}")
        self.record["data_s"] = round(time.monotonic() - t, 1)

    def restore(self, archives, accept: tuple[str, ...]) -> None:
        """Earlier pieces (restored even when stopping: what the piece had made travels on), then the
        checks that the restored results belong to this scale. Without archives, results an earlier
        piece left in this folder (a machine that keeps its files between commands) are checked the
        same way: the piece's Snakemake never reruns a job for changed settings alone, so a stale
        ``settings.json`` or run would otherwise stay and be packed as this piece's."""
        if not archives:
            self.check_left_over(accept)
            return
        record, R = self.record, self.R
        restored = restore_members(archives, skip=(f"{R}/data/",))
        record["restored_files"] = len(restored.files)
        record["kept_newer_local"] = restored.kept_local
        record["superseded"] = restored.superseded
        for s in restored.superseded:
            self.say(f"[piece] {s['file']}: the newer copy of {s['from']} replaces that of {s['over']}")
        if self.stopped is None:
            record["restored_runs"] = check_same_data(R)
            record["settings_compared"] = check_same_settings(self.settings, R, accept)
            record["accepted_differences"] = list(accept)

    def check_left_over(self, accept: tuple[str, ...]) -> None:
        """Refuses results of another experiment found in the results folder, naming the folder to clear."""
        R = self.R
        if self.stopped is not None or not Path(R, "settings.json").is_file():
            return
        try:
            self.record["restored_runs"] = check_same_data(R)
            self.record["settings_compared"] = check_same_settings(self.settings, R, accept)
        except PieceError as e:
            raise PieceError(f"results left in {R} by an earlier command do not belong to this configuration: {e}; "
                             f"remove {R} (keeping {R}/data) or run the piece in a fresh checkout") from None
        self.record["accepted_differences"] = list(accept)

    def plan(self, allow_rerun: bool) -> tuple[list[str], list[str]]:
        """(the piece's targets still to make, those of them not yet on disk); refused where the dry run
        would redo restored outputs or train a finished run again, unless ``allow_rerun``."""
        settings, piece, record, name = self.settings, self.piece, self.record, self.name
        cleared = complete_finished(settings, piece)
        if cleared:
            self.say(f"[piece] {name}: outputs whole but marked incomplete (an interrupted Snakemake), marked complete: "
                     f"{', '.join(cleared)}")
        record["completed_metadata"] = cleared
        finished = self.finished = finished_runs(settings, piece)
        record["skipped_runs"] = finished
        if finished:
            self.say(f"[piece] {name}: {len(finished)} of {len(piece.runs)} runs finished earlier, not trained again: "
                     f"{', '.join(finished)}")
        done = {t for run in finished for t in run_targets(settings, run)}
        todo = [t for t in self.targets if t not in done]
        pending = [t for t in todo if not Path(t).is_file()]
        plan: dict[str, int] = {}
        if self.stopped is None and self.stop.reason is None and pending:
            try:
                plan = planned_jobs(todo, self.config_args, [])
            except PieceError:
                if self.stop.reason is None:
                    raise
            self._refuse_redoing(plan, allow_rerun)
        record["planned_jobs"] = plan
        return todo, pending

    def _refuse_redoing(self, plan: dict[str, int], allow_rerun: bool) -> None:
        piece, R, settings = self.piece, self.R, self.settings
        unfinished = [r for r in piece.runs if not Path(f"{R}/runs/{r}/result.json").is_file()]
        allowed = {"train", "diagnose_run", "convert", "evaluate", "kernel_check_run", *piece.stages,
                   *(r for st in piece.stages for r in STAGE_RULES.get(st, ()))}
        redo = sorted(set(plan) - allowed)
        if redo and not allow_rerun:
            raise PieceError(f"the piece would also run {redo}: restored outputs would be redone "
                             "(see the dry run; --allow-rerun accepts it)")
        if plan.get("train", 0) > len(unfinished) and not allow_rerun:
            whole = set(self.finished) | set(unfinished)
            lacking = {r: [Path(x).relative_to(R).as_posix() for x in run_targets(settings, r)
                           if not Path(x).is_file()] for r in piece.runs if r not in whole}
            raise PieceError(f"the piece would train {plan['train']} runs, but only {len(unfinished)} have no "
                             f"result: {lacking} have a result.json but not these outputs, and making them "
                             "trains the run again (weights are not kept); --allow-rerun accepts it")

    def run_jobs(self, todo: list[str], pending: list[str]) -> set[str]:
        """Snakemake on the piece's targets (its jobs given the deadline, less the packing time); the
        runs trained in this invocation."""
        t = time.monotonic()
        trained: set[str] = set()
        self.stopped = self.stopped or self.stop.reason
        env = dict(SHARED_GPU_ENV) if self.sharing > 1 else {}
        if self.stopped is None and pending:
            if self.end is not None:  # stages that can stop early (throughput) keep their partial state for the next piece
                jobs_end = time.time() + (self.end - time.monotonic()) - PACK_MARGIN_S
                env[DEADLINE_ENV] = str(int(jobs_end))
                if jobs_end <= time.time():
                    self.stopped = "deadline"
                    self.say(f"[piece] {self.name}: the deadline leaves its jobs no time; nothing started")
            if self.stopped is None:
                before = _result_times(self.R, self.piece.runs)
                ran = _snakemake([*todo, *self.smk, "--rerun-triggers", *CONTINUE_TRIGGERS, "--config",
                                  *self.config_args], self.log, stop=self.stop, stop_at=self.stop_at, env=env)
                self.record["snakemake_exit"] = ran.returncode
                self.record["killed_after_grace"] = ran.killed
                self.stopped = ran.stopped
                after = _result_times(self.R, self.piece.runs)
                trained = {r for r, m in after.items() if before.get(r) != m}
        self.record["job_environment"] = env
        self.record["run_s"] = round(time.monotonic() - t, 1)
        return trained

    def conclude(self, since: float) -> None:
        """Whether the piece is complete, stopped (by its deadline or a signal) or failed."""
        record, name = self.record, self.name
        missing = self.missing = [t for t in self.targets if not Path(t).is_file()]
        if missing and self.stopped is None and self.end is not None and _stopped_at_deadline(self.R, missing, since):
            self.stopped = "deadline"
        if not missing:
            self.stopped = None  # everything is made: a late signal changes nothing
        record["stopped"] = self.stopped
        record["partial"] = bool(missing)
        record["exit_code"] = 0 if not missing else EXIT_STOPPED if self.stopped else 1
        if self.stopped:
            self.say(f"[piece] {name}: stopped ({self.stopped}); what finished is packed; run it again, restoring "
                     f"{Path(self.out) / (name + '.tar.xz')}, to continue")

    def pack(self, trained: set[str], started: str, earlier: list[dict], t0: float) -> None:
        """The record and the archive (a signal now changes nothing: what is written is complete)."""
        record, R, settings, piece, name = self.record, self.R, self.settings, self.piece, self.name
        summaries = _run_summaries(R, piece.runs, trained)
        record["run_results"] = summaries
        tokens = sum(s["tokens"] or 0 for s in summaries if s.get("trained_here"))
        record["trained_runs"] = sorted(trained)
        record["trained_tokens"] = tokens  # this invocation's training only
        record["aggregate_tokens_per_s"] = round(tokens / record["run_s"]) if record["run_s"] and tokens else None
        record["missing_targets"] = self.missing
        try:  # the device in the provenance: torch is asked only if imported
            import torch  # noqa: F401
        except ImportError:
            pass
        record["provenance"] = provenance({"piece": name, "settings": settings}, started=started)
        record["packed"] = pack(Path(self.out) / f"{name}.tar.xz", R, files=own_files(settings, piece))
        whole = set(finished_runs(settings, piece))
        left_out = {r["run_id"]: [Path(x).relative_to(R).as_posix() for x in run_targets(settings, r["run_id"])
                                  if not Path(x).is_file()] for r in summaries if r["done"] and r["run_id"] not in whole}
        record["runs_left_out"] = left_out  # trained, but a later output is missing: the weights stay here
        if left_out:
            self.say(f"[piece] {name}: runs trained but not packed, their later outputs missing (a rerun trains them "
                     f"again): {left_out}")
        record["wall_s"] = round(time.monotonic() - t0, 1)
        invocations = earlier + [_invocation(record)]
        record["invocations"] = invocations  # every invocation of the piece so far, this one last
        record["total_wall_s"] = round(sum(i.get("wall_s") or 0 for i in invocations), 1)
        record["total_trained_tokens"] = sum(i.get("trained_tokens") or 0 for i in invocations)
        atomic_write_json(Path(self.out) / f"{name}.json", record)


def piece_summary(archives: list[str]) -> dict[str, Any]:
    """What the pieces cost, from the ``<name>.json`` beside each ``<name>.tar.xz``: per piece its
    wall time on the GPU machine over all its invocations, runs and trained tokens, and the total in
    GPU-minutes (one GPU)."""
    rows = []
    for arc in archives:
        rec_path = _record_beside(str(arc))
        if rec_path is None or not rec_path.is_file():
            continue
        r = read_json(rec_path)
        invocations = r.get("invocations") or [_invocation(r)]
        rows.append({"piece": r.get("piece"), "runs": len(r.get("runs", [])), "wall_s": r.get("wall_s"),
                     "data_s": r.get("data_s"), "run_s": r.get("run_s"), "trained_tokens": r.get("trained_tokens"),
                     "aggregate_tokens_per_s": r.get("aggregate_tokens_per_s"),
                     "invocations": len(invocations),
                     "total_wall_s": r.get("total_wall_s", r.get("wall_s")),
                     "total_trained_tokens": r.get("total_trained_tokens", r.get("trained_tokens")),
                     "partial": bool(r.get("partial", False)),
                     "train_jobs_per_gpu": r.get("train_jobs_per_gpu", r.get("gpu_jobs")),
                     "device": (r.get("provenance") or {}).get("device"),
                     "commit": (r.get("provenance") or {}).get("commit")})
    total = sum(x["total_wall_s"] or 0 for x in rows)
    return {"piece_costs": rows, "gpu_minutes": round(total / 60, 1) if rows else None}


def render_report(settings: dict, restore_from: list[str], into: str, config_args: list[str],
                  extra: list[str], accept: tuple[str, ...] = ()) -> dict[str, Any]:
    """Restore every piece, render the report of the scale, and record it under ``into``."""
    R = settings["results"]
    try:
        restored = restore(restore_from, results=R)
    except ArchiveError as e:
        raise PieceError(str(e)) from None
    check_same_data(R)
    check_same_settings(settings, R, accept)
    Path(into).mkdir(parents=True, exist_ok=True)
    with open(Path(into) / "snakemake.log", "w", encoding="utf-8") as log:
        # only the rules that read small outputs: what the pieces made is taken as it is, never remade
        rc = _snakemake(["reports/paper.html", "--cores", "2", "--allowed-rules", *REPORT_RULES, *extra,
                         "--config", *config_args], log).returncode
    if rc != 0:
        raise PieceError(f"rendering the report failed (exit {rc}); see {Path(into) / 'snakemake.log'}")
    commits = sorted({read_json(p)["provenance"]["commit"] for p in Path(R).glob("runs/*/result.json")
                      if read_json(p).get("provenance", {}).get("commit")})
    for name in ("paper.html", "paper.json", "claims.tsv"):
        src = Path("reports") / name
        if src.is_file():
            with atomic_path(Path(into) / name) as tmp:
                Path(tmp).write_bytes(src.read_bytes())
    record = {"scale": settings.get("scale"), "restored_files": len(restored), "pieces": restore_from,
              "run_commits": commits, **piece_summary(restore_from),
              "provenance": provenance({"settings": settings})}
    atomic_write_json(Path(into) / "recorded.json", record)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres piece", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd in ("list", "run", "report"):
        sp = sub.add_parser(cmd)
        sp.add_argument("--config", dest="config_args", nargs="+", default=[],
                        help="Snakemake --config entries, e.g. scale=gpu (applied to config.yaml)")
        if cmd == "run":
            sp.add_argument("name", help="the piece to run")
            sp.add_argument("--out", required=True, help="folder for <name>.tar.xz, <name>.json, <name>.log")
            sp.add_argument("--cores", default="all")
            sp.add_argument("--deadline", type=float, default=None,
                            help=f"seconds for the whole piece (at least {MIN_DEADLINE_S}); at the deadline it "
                                 f"packs what finished and exits {EXIT_STOPPED}")
            sp.add_argument("--allow-rerun", action="store_true",
                            help="let the piece redo restored outputs (e.g. train a run again to make an output "
                                 "that needs its weights)")
        if cmd in ("run", "report"):
            sp.add_argument("--restore", nargs="*", default=[], help="archives of earlier pieces")
            sp.add_argument("--accept", nargs="*", default=[], metavar="KEY",
                            help="dotted setting keys whose difference from the restored pieces changes no result")
        if cmd == "report":
            sp.add_argument("--into", required=True, help="folder that records the rendered report")
        sp.add_argument("--smk", default="", help="more Snakemake arguments (one quoted string)")
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    for entry in args.config_args:
        key, _, value = entry.partition("=")
        if not value:
            p.error(f"--config {entry!r}: expected KEY=VALUE")
        overrides[key] = value
    try:
        settings = load_and_resolve("config.yaml", overrides)
        extra = shlex.split(args.smk)
        if args.cmd == "list":
            for piece in plan_pieces(settings):
                print(f"{piece.name}: {len(piece.runs)} runs, stages {list(piece.stages)}"
                      + (f", times {list(piece.presets)}" if piece.presets else ""))
                for t in piece_targets(settings, piece):
                    print(f"  {t}")
            return 0
        if args.cmd == "run":
            rec = run_piece(settings, args.name, args.out, restore_from=args.restore, config_args=args.config_args,
                            cores=args.cores, deadline_s=args.deadline,
                            allow_rerun=args.allow_rerun, extra=extra, accept=tuple(args.accept))
            print(json.dumps({k: rec[k] for k in ("piece", "wall_s", "run_s", "trained_tokens",
                                                   "aggregate_tokens_per_s", "skipped_runs", "stopped",
                                                   "missing_targets", "packed")}))
            return rec["exit_code"]
        rec = render_report(settings, args.restore, args.into, args.config_args, extra, tuple(args.accept))
        print(json.dumps({k: rec[k] for k in ("scale", "restored_files", "run_commits")}))
        return 0
    except (PieceError, ConfigError) as e:
        print(f"piece: {e}", file=sys.stderr)
        return 2
