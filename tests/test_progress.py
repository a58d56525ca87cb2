"""Progress for a person: a live bar on a terminal, whole lines in a log file (lrattnres.progress)."""

from __future__ import annotations

import io
import json
import os
import re
import sys

import pytest

from lrattnres import progress
from lrattnres.progress import PlainProgress, bar, duration, interactive, quiet_library_bars


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_interactive_only_for_a_terminal():
    assert interactive(FakeTerminal()) and not interactive(io.StringIO())
    closed = io.StringIO()
    closed.close()
    assert not interactive(closed) and not interactive(object())


def test_duration():
    assert [duration(x) for x in (0, 59.6, 61, 3599, 3600, 86400 + 62)] == ["0:00", "1:00", "1:01", "59:59",
                                                                           "1:00:00", "24:01:02"]
    assert duration(None) == duration(float("inf")) == duration(-1) == "?"


def test_plain_lines_at_most_every_interval_and_one_at_the_end():
    t = [0.0]
    out = io.StringIO()
    p = PlainProgress(total=100, desc="prepare-data (local)", unit="tok", stream=out, every_s=60, clock=lambda: t[0])
    for _ in range(10):
        t[0] += 10
        p.update(5)
    p.set_postfix(shards=2)
    p.close()
    p.close()  # a second close prints nothing more
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        "prepare-data (local): 30/100 tok (30%), 0.5 tok/s, elapsed 1:00, eta 2:20",
        "prepare-data (local): 50/100 tok (50%), 0.5 tok/s, elapsed 1:40, eta 1:40, shards 2",
    ]


def test_plain_lines_over_an_iterable_without_a_total_and_without_periodic_lines():
    t = [0.0]
    out = io.StringIO()

    def items():
        for i in range(3):
            t[0] += 1000
            yield i

    assert list(PlainProgress(items(), desc="scan", unit="shard", stream=out, every_s=0, clock=lambda: t[0])) == [0, 1, 2]
    assert out.getvalue() == "scan: 3 shard, 0.001 shard/s, elapsed 50:00\n"  # every_s=0: only the last line


def test_bar_is_tqdm_on_a_terminal_and_plain_lines_elsewhere():
    from tqdm import tqdm

    term = FakeTerminal()
    live = bar(range(3), desc="x", stream=term)
    assert isinstance(live, tqdm)
    assert list(live) == [0, 1, 2] and "\r" in term.getvalue()  # a live bar redraws its line
    log = io.StringIO()
    plain = bar(range(3), desc="x", stream=log)
    assert isinstance(plain, PlainProgress) and list(plain) == [0, 1, 2]
    assert "\r" not in log.getvalue() and log.getvalue().startswith("x: 3/3 it (100%)")
    assert isinstance(bar(range(3), stream=FakeTerminal(), live=False), PlainProgress)  # --no-progress


def _unset_switches(monkeypatch):
    for key in progress.LIBRARY_BAR_SWITCHES:
        monkeypatch.setenv(key, "")  # recorded, so that the test's changes are undone
        monkeypatch.delenv(key)


def test_library_bars_are_switched_off_only_off_a_terminal(monkeypatch):
    _unset_switches(monkeypatch)
    assert not quiet_library_bars(FakeTerminal())
    assert not any(k in os.environ for k in progress.LIBRARY_BAR_SWITCHES)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # a choice already made is kept
    assert quiet_library_bars(io.StringIO())
    assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_prepare_data_writes_whole_lines_to_a_log(tmp_path, monkeypatch):
    """The data stage with its progress on, writing to a log file (not a terminal): plain lines only."""
    from lrattnres.data import prepare

    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"document {i} " + "words of text " * 20}) + "\n")
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    prepare({"source": "local", "local": {"glob": str(tmp_path / "c.jsonl")}, "val_tokens": 200,
             "shard_tokens": 2000, "vocab": "compact"}, tmp_path / "data", progress=True)
    text = log.getvalue()
    assert "\r" not in text
    assert re.search(r"^prepare-data \(local\): [\d,]+ tok, .* tok/s, elapsed \d+:\d\d$", text, re.M), text
    assert re.search(r"^compaction: rewrite: \d+/\d+ shard \(100%\)", text, re.M), text


def test_the_stage_launcher_quiets_library_bars_in_a_log(monkeypatch):
    """``python -m lrattnres <stage>`` with stderr in a log file sets the libraries' switches before it
    imports the stage (which imports the libraries)."""
    import types

    from lrattnres import cli

    _unset_switches(monkeypatch)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    seen = {}
    probe = types.SimpleNamespace(main=lambda argv: seen.update(switch=os.environ.get("TQDM_DISABLE")) or 0)
    monkeypatch.setitem(cli.STAGES, "probe", ("probe_stage", "a stage that reads the switch"))
    monkeypatch.setitem(sys.modules, "probe_stage", probe)
    assert cli.main(["probe"]) == 0 and seen == {"switch": "1"}
