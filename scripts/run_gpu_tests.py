#!/usr/bin/env python3
"""Run the repository's GPU test suite on a CUDA machine and write one log.

    python scripts/run_gpu_tests.py [--log PATH] [--gpus N] [--all] [--tests PATH ...] [-- PYTEST_ARGS ...]

The suite (tests/conftest.py, ``--gpu-suite``) is every case of tests/test_kernels.py,
test_kernels_naive.py and test_kernels_tuner.py (on a GPU their kernels compile for the device
instead of running in Triton's interpreter) and every case marked ``gpu`` in the other test files.
``--all`` runs the whole test suite instead; ``--tests`` names the test files or folders to select
from (default: tests).  With N GPUs
(default: every visible one) the cases are dealt round-robin into N parts that run side by side, one
per GPU.

The log (default benchmarks/results/gpu_tests_<device>_<date>.log) starts with the commit, the
device and the versions, holds pytest's report of every case (each pass, each skip with its reason,
each failure) part by part, and ends with the counts, every skipped case and the wall time.  Exit
status: 0 when no case failed, 1 when one did, 2 without a CUDA device (``--allow-cpu`` runs anyway,
the GPU cases then skip: for checking this script).

A copy of the tree without its .git, or with a stale one (a GPU host), names its commit:

    LRATTNRES_COMMIT=<sha> python scripts/run_gpu_tests.py --log "$OUT/gpu_tests.log"
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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


def collect(selection: list[str], extra: list[str]) -> list[str]:
    """The node ids pytest selects."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "--collect-only", "-q",
                           *selection, *extra], cwd=REPO, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if proc.returncode not in (0, 5) or not ids:
        raise SystemExit(f"collection failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ids


def junit_summary(path: Path) -> dict:
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": []}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", type=Path, default=None, help="the log file (default benchmarks/results/gpu_tests_<device>_<date>.log)")
    p.add_argument("--gpus", type=int, default=None, help="parts run side by side, one per GPU (default: every visible GPU)")
    p.add_argument("--all", action="store_true", help="the whole test suite, not only the GPU suite")
    p.add_argument("--allow-cpu", action="store_true", help="run without a CUDA device (the GPU cases skip)")
    p.add_argument("--tests", nargs="+", default=["tests"], help="test files or folders to select from (default: tests)")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

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
    ids = collect(selection, extra)
    t0 = time.time()
    log = open(args.log, "w", encoding="utf-8")

    def say(line: str = "") -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    for line in header(argv):
        say(line)
    say(f"selected: {len(ids)} cases ({'the whole suite' if args.all else 'the GPU suite'}), in {parts} part(s)")
    say()

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels where CUDA is
    env["PYTHONUNBUFFERED"] = "1"
    # the GPU each part sees: the k-th of those this process sees (CUDA_VISIBLE_DEVICES may name some)
    shown = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    visible = shown[:ngpu] if len(shown) >= ngpu else [str(i) for i in range(ngpu)]
    tmp = Path(tempfile.mkdtemp(prefix="gpu-tests-"))
    procs = []
    for k in range(parts):
        part_ids = ids[k::parts]
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-rA", "--durations=25",
               f"--junitxml={tmp / f'part{k}.xml'}", *([] if args.all else ["--gpu-suite"]), *extra, *part_ids]
        part_env = dict(env, **({"CUDA_VISIBLE_DEVICES": visible[k]} if parts > 1 else {}))
        out = open(tmp / f"part{k}.log", "w", encoding="utf-8")
        procs.append((k, len(part_ids), subprocess.Popen(cmd, cwd=REPO, env=part_env, stdout=out,
                                                         stderr=subprocess.STDOUT), out))
    if parts == 1:  # one part: show its progress as it runs
        k, n, proc, out = procs[0]
        with open(tmp / "part0.log", encoding="utf-8") as follow:
            while proc.poll() is None:
                chunk = follow.read()
                if chunk:
                    print(chunk, end="", flush=True)
                time.sleep(1)
            print(follow.read(), end="", flush=True)
    codes = []
    for k, n, proc, out in procs:
        codes.append(proc.wait())
        out.close()
        say(f"===== part {k + 1} of {parts}: {n} cases" + (f", GPU {visible[k]}" if parts > 1 else "") + f", exit {codes[-1]}")
        log.write((tmp / f"part{k}.log").read_text(encoding="utf-8", errors="replace"))
        say()

    total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": []}
    for k in range(parts):
        s = junit_summary(tmp / f"part{k}.xml")
        for key in total:
            total[key] += s[key]
    wall = time.time() - t0
    say("===== summary")
    say(f"{total['passed']} passed, {total['failed']} failed, {total['errors']} errors, {total['skipped']} skipped "
        f"of {len(ids)} selected, in {wall:.0f} s")
    for name in total["failures"]:
        say(f"FAILED {name}")
    for skip in total["skips"]:
        say(f"SKIPPED {skip}")
    ran = total["passed"] + total["failed"] + total["errors"] + total["skipped"]
    if ran != len(ids):
        say(f"{len(ids) - ran} selected cases have no result (a part stopped early: see its exit status above)")
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"log: {args.log}")
    return 0 if all(c == 0 for c in codes) and ran == len(ids) else 1


if __name__ == "__main__":
    raise SystemExit(main())
