"""Provenance records: the commit, and LRATTNRES_COMMIT for a copied tree whose .git is stale."""

from __future__ import annotations

from lrattnres import provenance


def test_git_state_reads_head(monkeypatch):
    monkeypatch.delenv("LRATTNRES_COMMIT", raising=False)
    state = provenance.git_state()
    assert set(state) == {"commit", "dirty"}
    assert state["commit"] is None or len(state["commit"]) == 40


def test_git_state_takes_the_named_commit(monkeypatch):
    monkeypatch.setenv("LRATTNRES_COMMIT", "3a7fff6")
    assert provenance.git_state() == {"commit": "3a7fff6", "dirty": None}  # dirty: unknown
    assert provenance.provenance()["commit"] == "3a7fff6"
