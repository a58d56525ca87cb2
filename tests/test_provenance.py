"""Provenance records: the commit, and LRATTNRES_COMMIT for a copied tree whose .git is stale."""

from __future__ import annotations

import subprocess

from lrattnres import provenance


def test_git_state_reads_head(monkeypatch):
    """The tests run in a git checkout (CI clones the repository): the commit is its HEAD."""
    monkeypatch.delenv("LRATTNRES_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=provenance._REPO, capture_output=True, text=True)
    assert head.returncode == 0, f"{provenance._REPO} is not a git checkout: {head.stderr}"
    state = provenance.git_state()
    assert set(state) == {"commit", "dirty"}
    assert state["commit"] == head.stdout.strip() and len(state["commit"]) == 40
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=provenance._REPO,
                            capture_output=True, text=True, check=True).stdout
    assert state["dirty"] is bool(status.strip())
    assert provenance.provenance()["commit"] == state["commit"]


def test_git_state_takes_the_named_commit(monkeypatch):
    monkeypatch.setenv("LRATTNRES_COMMIT", "f" * 40)  # a commit this .git does not hold
    assert provenance.git_state() == {"commit": "f" * 40, "dirty": None}  # dirty: unknown
    assert provenance.provenance()["commit"] == "f" * 40


def test_named_commit_is_checked_where_the_git_holds_it(monkeypatch, tmp_path):
    """A named commit the .git holds is compared with the tracked files (a stale HEAD named for a newer
    tree shows as dirty); one it does not hold leaves "dirty" unknown."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    sha = git("rev-parse", "HEAD")
    monkeypatch.setattr(provenance, "_REPO", str(tmp_path))
    monkeypatch.setenv("LRATTNRES_COMMIT", sha)
    assert provenance.git_state() == {"commit": sha, "dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")  # the tree sent differs from the commit named
    assert provenance.git_state() == {"commit": sha, "dirty": True}
    monkeypatch.setenv("LRATTNRES_COMMIT", "0" * 40)  # a commit this .git does not hold
    assert provenance.git_state() == {"commit": "0" * 40, "dirty": None}
