#!/usr/bin/env python3
"""Run the repository's GPU test suite on a CUDA machine and write one log.

    python scripts/run_gpu_tests.py [--log PATH] [--gpus N] [--workers W] [--shard K/N] [--all]
                                    [--tests PATH ...] [-- PYTEST_ARGS ...]
    python scripts/run_gpu_tests.py --merge SHARD_LOG ... --log PATH

The suite (tests/conftest.py, ``--gpu-suite``) is every case of tests/test_kernels.py,
test_kernels_naive.py and test_kernels_tuner.py (on a GPU their kernels compile for the device
instead of running in Triton's interpreter) and every case marked ``gpu`` in the other test files.
``--all`` runs the whole test suite instead; ``--tests`` names the test files or folders to select
from (default: tests).

With N GPUs (default: every visible one) the cases are dealt round-robin into N parts that run side
by side, one per GPU.  ``--workers W`` runs W pytest-xdist workers on each GPU (the suite is bound
by compiling kernels, which W processes do at once; 8 on a 16-core H200 host).  Every part and worker
shares one Triton and one Inductor cache (--cache DIR to keep it between runs), and autotuning is
off (KERNELS_AUTOTUNE=0) but in the tuner's own cases, which turn it on in their settings.  Cases marked
``gpu_alone`` (they time GPU work, or start processes of their own that share the GPU) run after
the others in each part, one at a time.

What the suite costs (its cases, the kernel builds they ask for, the estimate of its time on one
H200): docs/kernel.md, "Checking a change", counted by scripts/gpu_suite_census.py.  A machine lent
for less time than that runs it in parts: ``--shard K/N`` runs the K-th of N round-robin shares of
the selected cases; each shard writes its own log and a JSON summary beside it (``LOG.json``), and
``--merge`` joins the N shard logs of one commit into one log, refusing shards of another commit,
another selection, or a missing or repeated share.

The log (default benchmarks/results/gpu_tests_<device>_<date>.log) starts with the commit, the
device and the versions, holds pytest's report of every case (one line per case as it finishes,
each skip with its reason, each failure with its traceback) part by part, and ends with the
counts, the SLOWEST cases with their seconds, every skipped case and the wall time; the JSON
summary holds every case's seconds (``durations``).  While the suite runs, each part's report grows in
``LOG.part<k>`` beside the log, so a run stopped from outside still leaves every finished case's
result.  Exit status: 0 when no case failed, 1 when one did, 2 without a CUDA device
(``--allow-cpu`` runs anyway, the GPU cases then skip: for checking this script).

A copy of the tree without its .git, or with a stale one (a GPU host), names its commit:

    LRATTNRES_COMMIT=<sha> python scripts/run_gpu_tests.py --workers 8 --log "$OUT/gpu_tests.log"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SLOWEST = 20  # the slowest cases the summary names, with their seconds (the JSON summary holds every case's)


def header(argv: list[str]) -> list[str]:
    """Who ran what where: commit, host, device, driver, versions."""
    sys.path.insert(0, str(REPO))
    import torch

    from lrattnres import provenance

    state = provenance.git_state()
    source = "LRATTNRES_COMMIT" if os.environ.get("LRATTNRES_COMMIT") else "git HEAD"
    versions = provenance.versions()
    for name in ("pytest", "pytest-xdist"):
        try:
            from importlib import metadata

            versions[name] = metadata.version(name)
        except Exception:  # noqa: BLE001  (absent: not listed)
            pass
    lines = [
        "GPU test suite of lrattnres (scripts/run_gpu_tests.py)",
        f"date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        f"commit: {state['commit']} ({source}; dirty: {state['dirty']})",
        f"host: {platform.node()} ({platform.platform()}, {os.cpu_count()} CPUs)",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
    else:
        lines.append("device: none (no CUDA device: every GPU case skips)")
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        lines.append(f"driver: {out.stdout.strip().splitlines()[0] if out.stdout.strip() else out.stderr.strip()}")
    lines.append(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    lines.append("environment: " + (" ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                             if k.startswith(("KERNELS_", "TRITON_", "TORCH", "CUDA_VISIBLE")))
                                      or "(no KERNELS_/TRITON_/TORCH*/CUDA_VISIBLE_DEVICES settings)"))
    lines.append(f"command: {shlex.join([sys.executable, str(Path(__file__).resolve().relative_to(REPO)), *argv])}")
    return lines


# One collection in a process of its own: the selected cases, each with its ``gpu_alone`` mark.  The
# caller's pytest arguments come first, so that the collection runs in one process and -v/-q in them
# leave the answer alone.
_COLLECT = """
import json, os, sys, pytest

class Seen:
    cases = []

    @pytest.hookimpl(trylast=True)  # after tests/conftest.py has selected and ordered the cases
    def pytest_collection_modifyitems(self, items):
        # each case as a path from the repository (a test file outside it too) and the node's own name
        self.cases[:] = [[os.path.relpath(i.path, os.getcwd()) + "::" + i.nodeid.split("::", 1)[1],
                          i.get_closest_marker("gpu_alone") is not None] for i in items]

seen = Seen()
code = pytest.main([*sys.argv[1:], "-p", "no:cacheprovider", "-n", "0", "--collect-only", "-q"], plugins=[seen])
print("CASES " + json.dumps({"code": int(code), "cases": seen.cases}))
"""


def collect(selection: list[str], extra: list[str]) -> list[tuple[str, bool]]:
    """The node ids pytest selects, each with whether it needs the GPU to itself."""
    proc = subprocess.run([sys.executable, "-c", _COLLECT, *extra, *selection], cwd=REPO, capture_output=True,
                          text=True)
    found = [line[6:] for line in proc.stdout.splitlines() if line.startswith("CASES ")]
    got = json.loads(found[-1]) if found else {"code": proc.returncode, "cases": []}
    if got["code"] not in (0, 5) or not got["cases"]:
        raise SystemExit(f"collection failed ({got['code']}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [(nodeid, alone) for nodeid, alone in got["cases"]]


def junit_summary(path: Path) -> dict:
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": [], "durations": {}}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out["durations"][name] = round(float(case.get("time") or 0), 2)
        kinds = {child.tag: child for child in case}
        if "skipped" in kinds:
            out["skipped"] += 1
            out["skips"].append(f"{name}: {kinds['skipped'].get('message', '')}")
        elif "failure" in kinds:
            out["failed"] += 1
            out["failures"].append(name)
        elif "error" in kinds:
            out["errors"] += 1
            out["failures"].append(f"{name} (error)")
        else:
            out["passed"] += 1
    return out


def add_counts(total: dict, s: dict) -> None:
    for key in ("passed", "failed", "errors", "skipped", "skips", "failures"):
        total[key] += s[key]
    total["durations"].update(s.get("durations", {}))


def summary_lines(total: dict, selected: int, wall: float) -> list[str]:
    lines = ["===== summary",
             f"{total['passed']} passed, {total['failed']} failed, {total['errors']} errors, {total['skipped']} skipped "
             f"of {selected} selected, in {wall:.0f} s"]
    slowest = sorted(total["durations"].items(), key=lambda kv: -kv[1])[:SLOWEST]
    lines += [f"SLOWEST {t:.1f} s {name}" for name, t in slowest]
    lines += [f"FAILED {name}" for name in total["failures"]]
    lines += [f"SKIPPED {skip}" for skip in total["skips"]]
    ran = total["passed"] + total["failed"] + total["errors"] + total["skipped"]
    if ran != selected:
        lines.append(f"{selected - ran} selected cases have no result (a part stopped early: see its exit status above)")
    return lines


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"--shard: expected K/N with 1 <= K <= N, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def run_part(k: int, ids: list[tuple[str, bool]], workers: int, common: list[str], env: dict, report: Path,
             tmp: Path, codes: dict) -> None:
    """One part on one GPU: its shared cases on ``workers`` pytest-xdist workers, then the cases that
    need the GPU to themselves, one at a time; pytest's report appended to ``report`` as it runs."""
    shared = [i for i, alone in ids if not alone]
    alone = [i for i, alone in ids if alone]
    phases = [("shared", shared, ["-n", str(workers), "--dist", "worksteal"] if workers > 1 else ["-n", "0"]),
              ("alone", alone, ["-n", "0"])]
    codes[k] = []
    with open(report, "a", encoding="utf-8") as out:
        for name, cases, dist in phases:
            if not cases:
                continue
            out.write(f"----- {name}: {len(cases)} cases" + (f" on {workers} workers" if name == "shared" and workers > 1
                                                             else ", one at a time") + "\n")
            out.flush()
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-ra", "--durations=25",
                   f"--junitxml={tmp / f'part{k}-{name}.xml'}", *common, *dist, *cases]
            codes[k].append(subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode)


def merge(logs: list[Path], into: Path) -> int:
    """Join the logs of the N shards of one run (their LOG.json summaries say which) into one log."""
    parts = []
    for log in logs:
        meta = log.with_name(log.name + ".json")
        if not log.exists() or not meta.exists():
            raise SystemExit(f"--merge: {log} or its summary {meta.name} is missing")
        parts.append((log, json.loads(meta.read_text(encoding="utf-8"))))
    first = parts[0][1]
    for log, m in parts:
        for key in ("commit", "selection", "shards", "selected_total"):
            if m.get(key) != first.get(key):
                raise SystemExit(f"--merge: {log.name} has {key} {m.get(key)!r}, {parts[0][0].name} has "
                                 f"{first.get(key)!r}: shards of one run only")
    shards = sorted(m["shard"] for _, m in parts)
    if shards != list(range(1, first["shards"] + 1)):
        raise SystemExit(f"--merge: shards {shards} given, expected each of 1..{first['shards']} once")
    parts.sort(key=lambda p: p[1]["shard"])
    total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": [], "durations": {}}
    for _, m in parts:
        add_counts(total, m)
    wall = sum(m["wall_s"] for _, m in parts)
    lines = [f"GPU test suite of lrattnres (scripts/run_gpu_tests.py), {first['shards']} shards merged "
             f"(scripts/run_gpu_tests.py --merge)", f"commit: {first['commit']}",
             f"selected: {first['selected_total']} cases ({first['selection']}), in {first['shards']} shards", ""]
    for log, m in parts:
        lines.append(f"##### shard {m['shard']} of {m['shards']}: {log.name}")
        lines += log.read_text(encoding="utf-8", errors="replace").splitlines()
        lines.append("")
    lines += summary_lines(total, first["selected_total"], wall)
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text("\n".join(lines) + "\n", encoding="utf-8")
    merged = dict(first, shard=None, wall_s=wall, selected=first["selected_total"], **total)
    into.with_name(into.name + ".json").write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    print("\n".join(summary_lines(total, first["selected_total"], wall)))
    print(f"log: {into}")
    ok = all(m["exit_ok"] for _, m in parts) and not total["failures"]
    return 0 if ok and sum(total[k] for k in ("passed", "failed", "errors", "skipped")) == first["selected_total"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", type=Path, default=None, help="the log file (default benchmarks/results/gpu_tests_<device>_<date>.log)")
    p.add_argument("--gpus", type=int, default=None, help="parts run side by side, one per GPU (default: every visible GPU)")
    p.add_argument("--workers", type=int, default=1, help="pytest-xdist workers on each GPU (default 1)")
    p.add_argument("--shard", type=parse_shard, default=(1, 1), metavar="K/N",
                   help="the K-th of N round-robin shares of the selected cases (default 1/1: all)")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="SHARD_LOG",
                   help="join these shard logs into --log instead of running anything")
    p.add_argument("--all", action="store_true", help="the whole test suite, not only the GPU suite")
    p.add_argument("--allow-cpu", action="store_true", help="run without a CUDA device (the GPU cases skip)")
    p.add_argument("--tests", nargs="+", default=["tests"], help="test files or folders to select from (default: tests)")
    p.add_argument("--cache", type=Path, default=None,
                   help="the Triton and Inductor cache folder every worker shares (default: a fresh one)")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.merge:
        if args.log is None:
            p.error("--merge needs --log, the merged log's path")
        return merge(args.merge, args.log)
    if args.workers < 1:
        p.error(f"--workers: expected at least 1, got {args.workers}")

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("run_gpu_tests: no CUDA device (torch.cuda.is_available() is False); the GPU suite needs one",
              file=sys.stderr)
        return 2
    # without CUDA (--allow-cpu), --gpus N still deals the cases into N parts, for checking the script
    ngpu = torch.cuda.device_count() if cuda else max(1, args.gpus or 1)
    parts = max(1, min(args.gpus or ngpu, ngpu))
    if args.log is None:
        slug = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_") if cuda else "cpu"
        args.log = REPO / "benchmarks" / "results" / f"gpu_tests_{slug}_{dt.date.today().isoformat()}.log"
    args.log.parent.mkdir(parents=True, exist_ok=True)

    selection = [*args.tests] if args.all else [*args.tests, "--gpu-suite"]
    every = collect(selection, extra)
    k_shard, n_shards = args.shard
    ids = every[k_shard - 1::n_shards]
    t0 = time.time()
    log = open(args.log, "w", encoding="utf-8")

    def say(line: str = "") -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    head = header(argv)
    for line in head:
        say(line)
    what = "the whole suite" if args.all else "the GPU suite"
    say(f"selected: {len(ids)} cases ({what}), in {parts} part(s)"
        + (f"; shard {k_shard} of {n_shards}: cases {k_shard}, {k_shard + n_shards}, {k_shard + 2 * n_shards}, ... "
           f"of {len(every)}" if n_shards > 1 else ""))
    say(f"workers: {args.workers} per GPU; {sum(a for _, a in ids)} cases marked gpu_alone run after the others, "
        "one at a time")
    say()

    # compiled kernels where CUDA is; and no pytest-xdist worker's variables from a pytest this runs under
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}
    env["PYTHONUNBUFFERED"] = "1"
    # one Triton and one Inductor cache for every part and worker, so that a kernel one worker built
    # is loaded, not built again, by the others; and no autotuning (each shape class would build and
    # time every candidate) except in the tuner's own cases, which ask for it in their settings
    cache = args.cache or Path(tempfile.mkdtemp(prefix="gpu-tests-cache-"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    env.setdefault("KERNELS_AUTOTUNE", "0")
    # the GPU each part sees: the k-th of those this process sees (CUDA_VISIBLE_DEVICES may name some)
    shown = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    visible = shown[:ngpu] if len(shown) >= ngpu else [str(i) for i in range(ngpu)]
    common = [] if args.all else ["--gpu-suite"]
    common += extra
    tmp = Path(tempfile.mkdtemp(prefix="gpu-tests-"))
    reports = [args.log.with_name(f"{args.log.name}.part{k}") for k in range(parts)]
    codes: dict[int, list[int]] = {}
    threads = []
    for k in range(parts):
        reports[k].write_text("", encoding="utf-8")
        part_env = dict(env, **({"CUDA_VISIBLE_DEVICES": visible[k]} if parts > 1 else {}))
        t = threading.Thread(target=run_part, args=(k, ids[k::parts], args.workers, common, part_env, reports[k],
                                                    tmp, codes))
        t.start()
        threads.append(t)
    if parts == 1:  # one part: show its progress as it runs
        with open(reports[0], encoding="utf-8") as follow:
            while threads[0].is_alive():
                chunk = follow.read()
                if chunk:
                    print(chunk, end="", flush=True)
                time.sleep(1)
            print(follow.read(), end="", flush=True)
    for t in threads:
        t.join()
    for k in range(parts):
        n, alone = len(ids[k::parts]), sum(a for _, a in ids[k::parts])
        exits = ", ".join(str(c) for c in codes.get(k, [])) or "none"
        say(f"===== part {k + 1} of {parts}: {n} cases ({alone} alone)" + (f", GPU {visible[k]}" if parts > 1 else "")
            + f", exit {exits}")
        log.write(reports[k].read_text(encoding="utf-8", errors="replace"))
        say()

    total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": [], "durations": {}}
    for xml in sorted(tmp.glob("part*.xml")):
        add_counts(total, junit_summary(xml))
    wall = time.time() - t0
    for line in summary_lines(total, len(ids), wall):
        say(line)
    log.close()
    for report in reports:
        report.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    ran = total["passed"] + total["failed"] + total["errors"] + total["skipped"]
    exit_ok = all(c == 0 for cs in codes.values() for c in cs)
    commit = next((line.split()[1] for line in head if line.startswith("commit: ")), None)
    meta = {"commit": commit, "selection": what, "tests": args.tests, "pytest_args": extra, "shard": k_shard,
            "shards": n_shards, "selected_total": len(every), "selected": len(ids), "wall_s": round(wall, 1),
            "exit_ok": exit_ok, **total}
    args.log.with_name(args.log.name + ".json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"log: {args.log}")
    return 0 if exit_ok and ran == len(ids) else 1


if __name__ == "__main__":
    raise SystemExit(main())
