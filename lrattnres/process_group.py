"""A command run as a process group that stops whole, and the signals that ask a caller to stop.

A piece (lrattnres/pieces.py) runs Snakemake, and Snakemake runs every job as a child process of its
own. Stopping only Snakemake leaves its jobs running: a training process would write its result
after the piece has packed its outputs and gone. So the command starts a session (and process
group) of its own, and stopping it signals the whole group: SIGTERM first (a training run writes its
checkpoint and exits 75, the timing stage keeps its partial state), then, after a grace period,
SIGKILL for what is left; the caller goes on only when no process of the group is alive. Should the
caller itself die (even by SIGKILL), the kernel sends the command SIGTERM, so that Snakemake starts
no new job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Signals that ask a running piece to stop, keep what finished and exit (75).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.2
# After SIGKILL, how long to wait for the group's members to be gone before giving up on them.
KILL_WAIT_S = 10.0


class StopRequest:
    """Within ``with StopRequest() as stop``, the stop signals set ``stop.reason`` (the first one's
    name, e.g. "SIGTERM") instead of ending the process; the former handlers come back on exit.
    Outside the main thread (where handlers cannot be set) nothing is caught."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.reason is None:
            self.reason = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                break
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class Outcome:
    returncode: int
    stopped: str | None  # why the group was stopped ("deadline", "SIGTERM", ...), None if it ended itself
    killed: list[int]  # processes that outlived the grace period and were killed


def _parent_death_signal() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():  # no /proc: ask the kernel whether the group has any process
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def _wait_gone(proc: subprocess.Popen, pgid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while True:
        proc.poll()
        if proc.returncode is not None and not members(pgid):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_S)


def stop_group(proc: subprocess.Popen, grace_s: float) -> list[int]:
    """SIGTERM to the group of ``proc``, SIGKILL to what is left after ``grace_s``; returns when no
    member is alive (or :data:`KILL_WAIT_S` after the SIGKILL), with the processes that were killed."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if _wait_gone(proc, pgid, grace_s):
        return []
    left = members(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _wait_gone(proc, pgid, KILL_WAIT_S)
    proc.wait()
    return left


def run(cmd: list[str], *, stdout, env: dict | None = None, stop: StopRequest | None = None,
        stop_at: float | None = None, grace_s: float = 15.0) -> Outcome:
    """Run ``cmd`` in a session of its own until it ends, ``stop`` is asked (a signal) or the monotonic
    time ``stop_at`` comes; then stop its whole group (:func:`stop_group`). Returns only when no
    process of the group is alive."""
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=_parent_death_signal)
    reason = None
    while proc.poll() is None:
        if stop is not None and stop.reason:
            reason = stop.reason
        elif stop_at is not None and time.monotonic() >= stop_at:
            reason = "deadline"
        if reason:
            break
        time.sleep(POLL_S)
    if reason is None and not members(proc.pid):
        return Outcome(proc.returncode, None, [])
    # stopped, or ended itself with processes of its group still running: none outlives the call
    killed = stop_group(proc, grace_s)
    return Outcome(proc.returncode, reason, killed)
