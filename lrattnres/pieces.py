"""A scale run in pieces that continue each other, on machines that keep nothing between them.

A GPU machine lent for a few minutes at a time cannot hold a whole scale: its disk is gone after each
command, and only small files come back. A *piece* is a group of training runs together with every
stage that needs their weights (routing diagnostics, conversion, downstream evaluation, Appendix I's
check of every routing read of the size pair), so the weights never have to leave the machine. The
scale's ``pieces`` list names the groups by run-id patterns; a run belongs to the first piece that
matches it.

A piece may also hold no runs, only stages (``stages: [throughput]``, optionally ``presets``: the
sizes it times). The throughput stage keeps its finished timed runs in a partial state beside its
output (kept by :data:`KEEP`); a piece run with ``--deadline`` passes ``LRATTNRES_DEADLINE`` to its
jobs, so the stage stops before the piece's time is up, and running the same piece again, restoring
its last archive, continues it until the result is complete.

``python -m lrattnres piece list`` shows the pieces and their jobs.
``python -m lrattnres piece run NAME --out DIR [--restore A.tar.xz ...]`` restores earlier pieces,
rebuilds the data (the manifest is deterministic, so restored results still match it), checks that
no restored result would be redone, runs the piece through Snakemake, and writes
``DIR/<name>.tar.xz``: the piece's small outputs (results, curves, logs, stage JSONs) with their
Snakemake metadata, and ``DIR/<name>.json``: what ran, how long, at what throughput.
``python -m lrattnres piece report --restore ... --into reports/recorded/<name>`` renders the report
from restored pieces on any machine (no GPU, no weights) and records it.

Continuing across machines and across commits: a restored output is never redone by Snakemake; instead
the restored results must have been made on the same data manifest (sha256) and with the same science
settings (every run's training spec, the scale's presets, recipe, data, grid and stage settings) as
the current configuration, or the piece refuses. A change of code alone does not redo a restored run;
the recorded report lists every commit its pieces ran at.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattnres.deadline import ENV as DEADLINE_ENV
from lrattnres.io import atomic_path, atomic_write_json, read_json
from lrattnres.provenance import now, provenance

# Files of a scale's results that a piece brings back (relative to <results>/<scale>/); weights,
# checkpoints and token shards stay on the machine.
# throughput/ holds each size's timing and, while unfinished, its partial state (<preset>.partial.json),
# which the next piece continues.
KEEP = ("settings.json", "accounting.json", "kernel_check.json", "throughput.json", "throughput/*.json",
        "data/manifest.json", "data/build.json", "runs/*/result.json", "runs/*/metrics.jsonl", "runs/*/spec.json",
        "diagnostics/*.json", "convert/*.json", "evaluate/*.json", "kernel_check/*.json", "logs/**/*")
STAGES = ("settings", "accounting", "kernel_check", "throughput")
# The rules a stage of a piece may run (the throughput stage: one job per size, then the merge).
STAGE_RULES = {"throughput": ("throughput_size", "throughput")}
# The rules that render the report from the pieces' small outputs (no weights needed).
REPORT_RULES = ("grid_summary", "convert_all", "diagnostics", "evaluate_pairs", "throughput", "kernel_check_trained",
                "report")
# Seconds a piece keeps for packing its outputs after LRATTNRES_DEADLINE (lrattnres/deadline.py)
PACK_MARGIN_S = 45
# Snakemake's rerun triggers while continuing: none of code, modification times, parameters or input
# lists (a new module in a stage's imports would redo every restored run). What decides whether a
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
                    "kernel_check")


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
    from lrattnres.gridplan import plan

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


def piece_targets(settings: dict, piece: Piece) -> list[str]:
    """The files a piece makes: per run its result, diagnostics, conversion and evaluation, and for
    the size pair's runs Appendix I's check of every routing read."""
    from lrattnres.gridplan import conversions, evaluations

    R = settings["results"]
    conv = {c["run_id"] for c in conversions(settings)}
    evals = {e["run_id"] for e in evaluations(settings)}  # the size pair's runs
    out = []
    for s in piece.stages:
        if s == "throughput" and piece.presets:  # some sizes: their own results, merged at the report
            out += [f"{R}/throughput/{p}.json" for p in piece.presets]
        else:
            out.append(f"{R}/{s}.json")
    for run in piece.runs:
        out += [f"{R}/runs/{run}/result.json", f"{R}/diagnostics/{run}.json"]
        if run in conv:
            out.append(f"{R}/convert/{run}.json")
        if run in evals:
            out += [f"{R}/evaluate/{run}.json", f"{R}/kernel_check/{run}.json"]
    return out


# ------------------------------------------------------------------------ bringing outputs back


def _metadata_name(path: str) -> str:
    """Snakemake's metadata file name for an output path (urlsafe base64 of the path)."""
    return base64.urlsafe_b64encode(path.encode()).decode()


def small_outputs(results: str) -> list[str]:
    """Existing files of ``results`` (a scale's folder) that a piece brings back, sorted."""
    root = Path(results)
    found: set[str] = set()
    for pattern in KEEP:
        found.update(p.as_posix() for p in root.glob(pattern) if p.is_file())
    return sorted(found)


def pack(out: str | os.PathLike, results: str, workdir: str = ".") -> dict[str, Any]:
    """Write the small outputs of ``results`` and their Snakemake metadata into an xz tarball."""
    cwd = Path(workdir)
    files = small_outputs(str(cwd / results))
    rel = [Path(f).relative_to(cwd).as_posix() for f in files]
    metas = [f".snakemake/metadata/{_metadata_name(r)}" for r in rel]
    metas = [m for m in metas if (cwd / m).is_file()]
    with atomic_path(out) as tmp:
        # dereference: a job's log and its attempt's copy are one file under two names (a hard link,
        # lrattnres/attempts.py); each goes in as a plain file, which restore() accepts
        with tarfile.open(tmp, "w:xz", dereference=True) as tar:
            for r in rel + metas:
                info = tar.gettarinfo(str(cwd / r), arcname=r)
                if info.islnk():  # a hard link (an attempt's kept log): stored as the file it links
                    info.type, info.linkname, info.size = tarfile.REGTYPE, "", (cwd / r).stat().st_size
                with open(cwd / r, "rb") as f:
                    tar.addfile(info, f)
    return {"files": len(rel), "metadata": len(metas), "bytes": os.path.getsize(out)}


def restore(tarballs: list[str], workdir: str = ".", *, skip: tuple[str, ...] = ()) -> list[str]:
    """Unpack pieces into ``workdir`` (modification times kept); members under ``skip`` prefixes are
    left out. Refuses members that would land outside ``workdir``."""
    cwd = Path(workdir).resolve()
    restored = []
    for tb in tarballs:
        try:
            tar = tarfile.open(tb, "r:xz")
        except (OSError, tarfile.TarError) as e:
            raise PieceError(f"{tb}: not a piece archive ({e})") from None
        with tar:
            for m in tar.getmembers():
                dest = (cwd / m.name).resolve()
                if not str(dest).startswith(str(cwd) + os.sep) or not (m.isfile() or m.isdir()):
                    raise PieceError(f"{tb}: member {m.name!r} is not a plain file inside the working tree")
                if any(m.name.startswith(s) for s in skip):
                    continue
                tar.extract(m, str(cwd), filter="data" if hasattr(tarfile, "data_filter") else None)
                restored.append(m.name)
    return restored


def check_same_data(results: str) -> int:
    """Every restored training result was trained on the current data manifest; returns how many."""
    from lrattnres.data.manifest import sha256_file

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
    """The restored scale's science settings and every restored run's training spec equal the
    current ones, but for the dotted keys in ``accept`` (differences an operator has judged not to
    change the results, e.g. a new key whose default is the old behaviour); returns the sections
    compared. Raises naming the first difference."""
    from lrattnres.train import spec as spec_mod

    def differs(old, new) -> list[str]:
        keys = spec_mod.diff_keys(old if isinstance(old, dict) else {"": old},
                                  new if isinstance(new, dict) else {"": new}, ignore=())
        return [k for k in keys if not any(k == a or k.startswith(a + ".") for a in accept)]

    from lrattnres.gridplan import plan, train_spec

    saved_path = Path(results) / "settings.json"
    if not saved_path.is_file():
        raise PieceError(f"{saved_path}: missing (the first piece writes it)")
    saved = read_json(saved_path)
    compared = []
    for key in SCIENCE_SECTIONS:
        if key in saved or key in settings:
            keys = differs(saved.get(key), settings.get(key))
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


def _snakemake(args: list[str], log, timeout: float | None = None, env: dict | None = None) -> int:
    cmd = [sys.executable, "-m", "snakemake", *args]
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    try:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})}).returncode
    except subprocess.TimeoutExpired:
        log.write(f"[piece] snakemake stopped at the deadline ({timeout:.0f} s)\n")
        return 124


def planned_jobs(targets: list[str], config_args: list[str], extra: list[str]) -> dict[str, int]:
    """Snakemake's dry-run job counts (rule -> count) for ``targets``."""
    cmd = [sys.executable, "-m", "snakemake", *targets, "-n", "--quiet", "rules", *extra,
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


def _run_summaries(results: str, runs: tuple[str, ...]) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        path = Path(results) / "runs" / run / "result.json"
        if not path.is_file():
            out.append({"run_id": run, "done": False})
            continue
        r = read_json(path)
        out.append({"run_id": run, "done": True, "final_val_ce": r.get("final_val_ce"),
                    "final_train_ce": r.get("final_train_ce"), "data_epochs": r.get("data_epochs"),
                    "tokens": r.get("tokens"), "wall_s": r.get("wall_s"), "train_s": r.get("train_s"),
                    "tokens_per_s": r.get("tokens_per_s"), "steady_tokens_per_s": r.get("steady_tokens_per_s")})
    return out


def run_piece(settings: dict, name: str, out: str, *, restore_from: list[str], config_args: list[str],
              cores: str, deadline_s: float | None, allow_rerun: bool,
              extra: list[str], accept: tuple[str, ...] = ()) -> dict[str, Any]:
    pieces = {p.name: p for p in plan_pieces(settings)}
    if name not in pieces:
        raise PieceError(f"no piece {name!r}; the scale's pieces are {list(pieces)}")
    piece = pieces[name]
    R = settings["results"]
    started, t0 = now(), time.monotonic()
    Path(out).mkdir(parents=True, exist_ok=True)
    logs = Path(out) / f"{name}.log"
    smk = [*extra, "--cores", cores, "--scheduler", "greedy", "--keep-going", "--nolock"]
    sharing = int(settings.get("resources", {}).get("train", {}).get("jobs_per_gpu", 1))
    record: dict[str, Any] = {"piece": name, "scale": settings.get("scale"), "runs": list(piece.runs),
                              "stages": list(piece.stages), "train_jobs_per_gpu": sharing,
                              "restored_from": restore_from,
                              "environment": {k: v for k, v in sorted(os.environ.items())
                                              if k.startswith(("KERNELS_", "LRATTNRES_", "TRITON_", "TORCH"))}}
    with open(logs, "a", encoding="utf-8") as log:
        # 1. the data, built here (deterministic: the same bytes as where earlier pieces ran)
        t = time.monotonic()
        manifest = f"{R}/data/manifest.json"
        rc = _snakemake([manifest, *smk, "--config", *config_args], log)
        if rc != 0:
            raise PieceError(f"building the data failed (exit {rc}); see {logs}")
        record["data_s"] = round(time.monotonic() - t, 1)
        # 2. earlier pieces, then the checks that nothing restored is redone
        if restore_from:
            restored = restore(restore_from, skip=(f"{R}/data/",))
            record["restored_files"] = len(restored)
            record["restored_runs"] = check_same_data(R)
            record["settings_compared"] = check_same_settings(settings, R, accept)
            record["accepted_differences"] = list(accept)
        targets = piece_targets(settings, piece)
        plan = planned_jobs(targets, config_args, [])
        record["planned_jobs"] = plan
        allowed = {"train", "diagnose_run", "convert", "evaluate", "kernel_check_run", *piece.stages,
                   *(r for st in piece.stages for r in STAGE_RULES.get(st, ()))}
        redo = sorted(set(plan) - allowed)
        if redo and not allow_rerun:
            raise PieceError(f"the piece would also run {redo}: restored outputs would be redone "
                             "(see the dry run; --allow-rerun accepts it)")
        if plan.get("train", 0) > len(piece.runs):
            raise PieceError(f"the piece would train {plan['train']} runs, more than its {len(piece.runs)}: "
                             "restored runs would be redone")
        # 3. the piece
        t = time.monotonic()
        left = None if deadline_s is None else max(60.0, deadline_s - (time.monotonic() - t0))
        env = dict(SHARED_GPU_ENV) if sharing > 1 else {}
        if left is not None:  # stages that can stop early (throughput) keep their partial state for the next piece
            env[DEADLINE_ENV] = str(int(time.time() + left - PACK_MARGIN_S))
        record["job_environment"] = env
        rc = _snakemake([*targets, *smk, "--rerun-triggers", *CONTINUE_TRIGGERS, "--config", *config_args],
                        log, timeout=left, env=env)
        record["snakemake_exit"] = rc
        record["run_s"] = round(time.monotonic() - t, 1)
    summaries = _run_summaries(R, piece.runs)
    record["run_results"] = summaries
    done = [s for s in summaries if s["done"]]
    tokens = sum(s["tokens"] or 0 for s in done)
    record["trained_tokens"] = tokens
    record["aggregate_tokens_per_s"] = round(tokens / record["run_s"]) if record["run_s"] else None
    record["missing_targets"] = [t for t in targets if not Path(t).is_file()]
    record["wall_s"] = round(time.monotonic() - t0, 1)
    try:  # the device in the provenance: torch is asked only if imported
        import torch  # noqa: F401
    except ImportError:
        pass
    record["provenance"] = provenance({"piece": name, "settings": settings}, started=started)
    record["packed"] = pack(Path(out) / f"{name}.tar.xz", R)
    atomic_write_json(Path(out) / f"{name}.json", record)
    return record


def piece_summary(archives: list[str]) -> dict[str, Any]:
    """What the pieces cost, from the ``<name>.json`` beside each ``<name>.tar.xz``: per piece its
    wall time on the GPU machine, runs and trained tokens, and the total in GPU-minutes (one GPU)."""
    rows = []
    for arc in archives:
        rec_path = Path(str(arc)[: -len(".tar.xz")] + ".json") if str(arc).endswith(".tar.xz") else None
        if rec_path is None or not rec_path.is_file():
            continue
        r = read_json(rec_path)
        rows.append({"piece": r.get("piece"), "runs": len(r.get("runs", [])), "wall_s": r.get("wall_s"),
                     "data_s": r.get("data_s"), "run_s": r.get("run_s"), "trained_tokens": r.get("trained_tokens"),
                     "aggregate_tokens_per_s": r.get("aggregate_tokens_per_s"),
                     "train_jobs_per_gpu": r.get("train_jobs_per_gpu", r.get("gpu_jobs")),
                     "device": (r.get("provenance") or {}).get("device"),
                     "commit": (r.get("provenance") or {}).get("commit")})
    total = sum(x["wall_s"] or 0 for x in rows)
    return {"piece_costs": rows, "gpu_minutes": round(total / 60, 1) if rows else None}


def render_report(settings: dict, restore_from: list[str], into: str, config_args: list[str],
                  extra: list[str], accept: tuple[str, ...] = ()) -> dict[str, Any]:
    """Restore every piece, render the report of the scale, and record it under ``into``."""
    R = settings["results"]
    restored = restore(restore_from)
    check_same_data(R)
    check_same_settings(settings, R, accept)
    Path(into).mkdir(parents=True, exist_ok=True)
    with open(Path(into) / "snakemake.log", "w", encoding="utf-8") as log:
        # only the rules that read small outputs: what the pieces made is taken as it is, never remade
        rc = _snakemake(["reports/paper.html", "--cores", "2", "--allowed-rules", *REPORT_RULES, *extra,
                         "--config", *config_args], log)
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
    from lrattnres.config import ConfigError, load_and_resolve

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
            sp.add_argument("--deadline", type=float, default=None, help="seconds for the whole piece")
            sp.add_argument("--allow-rerun", action="store_true")
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
                                                   "aggregate_tokens_per_s", "missing_targets", "packed")}))
            return 0 if not rec["missing_targets"] else 1
        rec = render_report(settings, args.restore, args.into, args.config_args, extra, tuple(args.accept))
        print(json.dumps({k: rec[k] for k in ("scale", "restored_files", "run_commits")}))
        return 0
    except (PieceError, ConfigError) as e:
        print(f"piece: {e}", file=sys.stderr)
        return 2
