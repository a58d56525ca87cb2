"""kernels.tuner on the CPU, with fake launchers and a fake device: which failures pass over a
candidate (a resource error at compile, load or launch on a healthy device) and which stop tuning
(a CUDA fault: the context is broken, every later launch would fail), and that no candidate is
launched before every candidate is built."""

from __future__ import annotations

import pytest
import torch

import kernels.tuner as tuner

CUDA = torch.device("cuda")


class FakeDevice:
    """A device whose context breaks when a launch faults (as a CUDA fault is sticky)."""

    def __init__(self):
        self.fault = None

    def check(self, device):
        return self.fault


@pytest.fixture
def dev(monkeypatch):
    fake = FakeDevice()
    monkeypatch.setattr(tuner, "cuda_fault", fake.check)
    monkeypatch.setattr(tuner, "gpu_time", lambda fn: (fn(), 1.0)[1])
    return fake


def _launcher(dev, events, fail=None):
    """launch(cfg, warm): logs ("build" | "launch", cfg); ``fail`` maps a cfg's name to (when, exc, faults)."""
    fail = fail or {}

    def launch(cfg, warm=False):
        when = "build" if warm else "launch"
        events.append((when, cfg["name"]))
        rule = fail.get(cfg["name"])
        if rule and rule[0] == when:
            if rule[2]:
                dev.fault = "AcceleratorError: CUDA error: misaligned address"
            raise rule[1]

    return launch


CANDS = [{"name": n} for n in "abcd"]


def test_every_candidate_is_built_before_any_launch(dev):
    events = []
    best = tuner.fastest(CANDS, _launcher(dev, events), CUDA, "fwd/512x3/S9/N8192")
    builds = [i for i, e in enumerate(events) if e[0] == "build"]
    launches = [i for i, e in enumerate(events) if e[0] == "launch"]
    assert len(builds) == 4 and max(builds) < min(launches)
    assert best == CANDS[0]  # all equally fast: the first


def test_resource_errors_pass_over_a_candidate(dev, monkeypatch):
    """A build error (registers, shared memory) leaves the candidate out before any launch; a launch
    error on a healthy device (too many resources requested) passes over it; the others are timed."""
    from triton.runtime.errors import OutOfResources

    events = []
    fail = {"a": ("build", OutOfResources(300000, 232448, "shared memory"), False),
            "b": ("launch", RuntimeError("Triton Error [CUDA]: too many resources requested for launch"), False)}
    times = {"c": 2.0, "d": 1.5}
    last = []
    launch = _launcher(dev, events, fail)

    def timed(cfg, warm=False):
        last[:] = [cfg["name"]]
        return launch(cfg, warm)

    monkeypatch.setattr(tuner, "gpu_time", lambda fn: (fn(), times[last[0]])[1])
    best = tuner.fastest(CANDS, timed, CUDA)
    assert best == CANDS[3]
    assert ("launch", "a") not in events and ("launch", "c") in events


def test_a_fault_stops_tuning_and_names_the_candidate(dev):
    """A candidate whose first launch faults (misaligned address) stops tuning at once with
    TuningFault, naming the candidate and the shape class; no later candidate is launched."""
    events = []
    fail = {"b": ("launch", RuntimeError("Triton Error [CUDA]: misaligned address"), True)}
    with pytest.raises(tuner.TuningFault, match=r"fwd/128x3/key2/S3/N16384.*'name': 'b'.*misaligned address"):
        tuner.fastest(CANDS, _launcher(dev, events, fail), CUDA, "fwd/128x3/key2/S3/N16384")
    assert ("launch", "c") not in events


def test_a_fault_reported_after_the_launch_is_the_candidates(dev):
    """A launch returns before its kernel runs: the fault of candidate b shows at the synchronisation
    after b's warm-up launch, and is b's, not c's."""
    events = []

    def launch(cfg, warm=False):
        events.append(("build" if warm else "launch", cfg["name"]))
        if not warm and cfg["name"] == "b":
            dev.fault = "AcceleratorError: CUDA error: misaligned address"  # raised nowhere: asynchronous

    with pytest.raises(tuner.TuningFault, match=r"first launch \(candidate \{'name': 'b'\}\)"):
        tuner.fastest(CANDS, launch, CUDA)
    assert ("launch", "c") not in events


def test_a_fault_pending_before_tuning_is_not_blamed_on_a_candidate(dev):
    events = []
    dev.fault = "AcceleratorError: CUDA error: an illegal memory access was encountered"
    with pytest.raises(tuner.TuningFault, match="before tuning started.*earlier GPU work"):
        tuner.fastest(CANDS, _launcher(dev, events), CUDA)
    assert events == []


def test_a_fault_while_building_stops_tuning(dev):
    events = []
    fail = {"c": ("build", RuntimeError("Triton Error [CUDA]: misaligned address"), True)}
    with pytest.raises(tuner.TuningFault, match="while building a candidate"):
        tuner.fastest(CANDS, _launcher(dev, events, fail), CUDA)
    assert not any(e[0] == "launch" for e in events)


def test_no_candidate_runs_lists_each_error(dev):
    events = []
    fail = {n: ("launch", RuntimeError(f"no {n}"), False) for n in "abcd"}
    with pytest.raises(RuntimeError, match=r"no launch configuration ran \(4 tried, sum/4x3\).*no a.*no d"):
        tuner.fastest(CANDS, _launcher(dev, events, fail), CUDA, "sum/4x3")


def test_cuda_fault_probe_on_other_devices():
    assert tuner.cuda_fault(None) is None and tuner.cuda_fault(torch.device("cpu")) is None
