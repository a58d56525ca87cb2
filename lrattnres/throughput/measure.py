"""The measurement: one timed run of a method (warm-up, then the trainer's updates until the stopping
rule), and the protocol over presets, repeats and methods in rotation, with the rows and gains of
the result.

Each method's model and loss module are built, and compiled, once per process (:class:`MethodSlot`):
every timed run loads its repeat's shared starting weights into the same parameters and starts from
a fresh optimiser, so the compiled graph serves every repeat without recompiling (each run records
how many graphs Dynamo compiled during it). Between runs a model gives its device memory back, so
only the timed model is on the GPU; the shared starting weights stay on the host."""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

from lrattnres import deadline, memory
from lrattnres.checks import is_int
from lrattnres.data import load_manifest
from lrattnres.devices import resolve_device
from lrattnres.presets import PAPER_VOCAB, get_preset
from lrattnres.provenance import now, provenance
from lrattnres.throughput.comparison import compare
from lrattnres.throughput.matched import (build_method_model, data_buffer, fla_available, load_shared, method_config,
                                          release_weights, shared_backbone, synthetic_buffer)
from lrattnres.throughput.protocol import mean_ci95, more_repeats, paired_gain, should_stop
from lrattnres.throughput.spec import GAINS, METHOD_TABLE, PAPER_SIZES, SMALL_VOCAB, for_preset, resolve_spec
from lrattnres.throughput.summary import claims_for
from lrattnres.train import spec as train_spec

# Where the stage keeps the shared starting weights between runs: on the host (the memory estimate's layout).
SHARED_ON_GPU = False


class MethodFailed(RuntimeError):
    """A method that cannot be timed where it must be (it ran out of GPU memory): the job fails,
    naming the method; the finished runs stay in the partial state."""


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_spec() -> dict:
    import copy

    return copy.deepcopy(train_spec.DEFAULTS)


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far (0 where the counter is not kept)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # an older or newer torch without the counter
        return 0


class MethodSlot:
    """One method's model and loss module (with ``compile``, compiled), built once per process and
    reused by every timed run of the method: :meth:`load` puts a repeat's shared weights into the same
    parameters, :meth:`release` gives their device memory back between runs."""

    def __init__(self, preset: str, name: str, s: dict, vocab_size: int, device, precision: str):
        import torch

        from lrattnres.train.loop import LossModule

        self.name = name
        self.model = build_method_model(preset, name, s, vocab_size, device)
        self.model.train()
        self.lm = LossModule(self.model, precision)
        self.fwd = torch.compile(self.lm, dynamic=False) if s["compile"] else self.lm
        self.runs = 0  # timed runs in this process (the first compiles)

    def load(self, shared: dict) -> None:
        load_shared(self.model, self.name, shared)

    def release(self) -> None:
        release_weights(self.model)


def time_method(model, batches: list, s: dict, device, precision: str, log=None,
                guard: Callable[[float], None] | None = None, fwd=None, lm=None) -> dict:
    """Warm-up updates, then measured updates until :func:`should_stop`; returns the times.

    Each update is the trainer's: ``accumulate_gradients`` (transfer, forward, backward over the
    micro-batches, clipping) then ``apply_update`` (Muon + AdamW, zero_grad), with the device
    synchronised before and after; nothing else is inside the timed region. The optimisers are new
    (no state from an earlier run). ``fwd``/``lm``: the slot's (compiled) loss module; without them
    they are made here. ``guard(seconds)`` is called before every update after the first with the last
    update's duration (it raises to stop: the deadline, lrattnres/deadline.py). Compilation happens in
    the first warm-up update: ``compile_s`` is its excess over the median measured update where Dynamo
    compiled graphs during the run (``graphs_compiled``), else 0; the guard is not given that update's
    time (the deadline would stop a run whose next update takes seconds for want of minutes).
    """
    import torch

    from lrattnres.train.loop import LossModule, accumulate_gradients, apply_update
    from lrattnres.train.optim import build_optimizers

    ts = _train_spec()
    if lm is None:
        lm = LossModule(model, precision)
    if fwd is None:
        fwd = torch.compile(lm, dynamic=False) if s["compile"] else lm
    optimizers = build_optimizers(model, ts["optim"], device.type)
    params = [p for p in model.parameters() if p.requires_grad]
    z, clip = float(ts["z_loss"]), ts["grad_clip"]

    from lrattnres.attention import resolve_backend, warn_compiled_flex

    segments = resolve_backend(model.cfg.attention, device) == "flash"
    warn_compiled_flex(model.cfg.attention, device, s["compile"])

    def update():
        ce, zl, gn = accumulate_gradients(fwd, lm, batches, params, device, z, clip, segments=segments)
        if not all(math.isfinite(v) for v in (ce, zl, gn)):
            raise RuntimeError(f"non-finite loss or gradient norm during timing (ce {ce}, z {zl}, norm {gn})")
        apply_update(optimizers, device)
        return ce

    graphs0 = graphs_compiled()
    gc.collect()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    last = first = None
    for i in range(s["warmup"]):
        if guard is not None and last is not None:
            guard(last)
        t = time.perf_counter()
        update()
        _sync(device)
        last = time.perf_counter() - t
        first = last if first is None else first
        if i == 0 and graphs_compiled() > graphs0:
            last = 0.0  # it compiled: its time says nothing of the next update's
    _sync(device)
    warm_s = time.perf_counter() - t0
    times: list[float] = []
    while True:
        if guard is not None and (times or last is not None):
            guard(times[-1] if times else last)
        _sync(device)
        t = time.perf_counter()
        ce = update()
        _sync(device)
        times.append(time.perf_counter() - t)
        stop, why = should_stop(times, min_updates=s["min_updates"], max_updates=s["max_updates"],
                                window=s["window"], stride=s["stride"], cv=s["cv"], drift=s["drift"])
        if stop:
            break
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    wdtype = str(next(model.parameters()).dtype).replace("torch.", "")
    graphs = graphs_compiled() - graphs0
    first = times[0] if first is None else first
    compile_s = max(0.0, first - statistics.median(times)) if graphs else 0.0
    del optimizers
    return {"times_s": times, "warmup_s": warm_s, "stopped": why, "final_ce": ce, "peak_mem_gib": peak,
            "weights_dtype": wdtype, "first_update_s": first, "graphs_compiled": graphs, "compile_s": compile_s}


def _free(device) -> None:
    """Give freed device memory back to the GPU (on the CPU reference counting has freed it already;
    a full collection there costs more than a short run)."""
    import torch

    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def gpu_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}"


def rotation(methods: list[str], repeat: int) -> list[str]:
    """Method order of repeat ``repeat``: rotated left by ``repeat``."""
    k = repeat % len(methods)
    return methods[k:] + methods[:k]


def _pair(s: dict) -> tuple[str, str]:
    """The numerator and denominator of the gain the extra repeats resolve (``resolve_gain``)."""
    return next((num, den) for g, num, den in GAINS if g == s["resolve_gain"])


def out_of_memory(e: BaseException) -> bool:
    """Whether an error is the GPU running out of memory: the allocator's ``torch.OutOfMemoryError``,
    or a CUDA error of that kind raised elsewhere (a library's workspace)."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_estimate(runs: list[dict], compiled_here: bool) -> float | None:
    """Seconds the next timed run of a size should take, from its finished runs: the longest run
    without its compilation, plus the longest compilation where the method is not compiled in this
    process yet. None before any run has finished."""
    if not runs:
        return None
    body = max(r["warmup_s"] - (r.get("compile_s") or 0.0) + sum(r["times_s"]) for r in runs)
    return body + (0.0 if compiled_here else max((r.get("compile_s") or 0.0) for r in runs))


def memory_plan(presets: list[dict], s: dict, cluster: dict | None, device) -> dict:
    """The stage's estimated peak GPU memory per size and method (lrattnres/memory.py), checked before
    anything is built against ``cluster.gpu_memory_gib`` less ``cluster.memory_margin`` and, on a GPU,
    against this GPU's memory less the same margin: :class:`lrattnres.memory.FitError` where it does
    not fit. Without a cluster's memory and anchors nothing is estimated."""
    if not cluster or not cluster.get("gpu_memory_gib") or not cluster.get("memory_anchors"):
        return {"checked": False, "why": "no cluster.gpu_memory_gib and cluster.memory_anchors given"}
    rows = []
    for plan in presets:
        shape = dict(get_preset(plan["preset"]), vocab_size=plan["vocab"])
        for name in plan["methods"]:
            cfg = method_config(plan["preset"], name, s, plan["vocab"])
            est = memory.throughput_estimate(shape, micro_batch=s["micro_batch"], seq_len=s["seq_len"],
                                             cluster=cluster, method=METHOD_TABLE[name]["method"],
                                             rank=cfg.get("rank"), shared_on_gpu=SHARED_ON_GPU, idle_models=0)
            rows.append({"preset": plan["preset"], "method": name, "micro_batch": s["micro_batch"],
                         "seq_len": s["seq_len"], **est})
    memory.check_throughput(rows, cluster, "memory check")
    out = {"checked": True, "gpu_memory_gib": cluster["gpu_memory_gib"], "memory_margin": cluster.get("memory_margin", 0.0),
           "limit_gib": cluster["gpu_memory_gib"] * (1 - cluster.get("memory_margin", 0.0)),
           "shared_weights": "gpu" if SHARED_ON_GPU else "host", "rows": rows}
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory / memory.GIB
        memory.check_throughput(rows, dict(cluster, gpu_memory_gib=round(total, 1)), "memory check",
                                memory_of=f"this GPU's memory ({gpu_name(device)})")
        out["device_memory_gib"] = total
    return out


def run(spec: dict, data: str | None = None, log=None, on_repeat: Callable[[dict], None] | None = None,
        partial: dict | None = None, on_run: Callable[[dict], None] | None = None,
        cluster: dict | None = None) -> dict:
    """Run the protocol; returns the result dict (``on_repeat`` gets the partial result after every repeat).

    ``partial``: the state of an earlier, unfinished run of the same spec (:func:`partial_state`):
    its timed runs are taken as they are and only the missing ones are timed (the matched weights of
    a repeat are a function of the seed and the repeat, so a repeat may be finished by another
    process). ``on_run`` gets the partial state after every timed run, and when the stage stops
    early. With ``LRATTNRES_DEADLINE`` set, no run starts that would not end before it, and a run
    under way stops between updates: :class:`lrattnres.deadline.DeadlineReached` (the finished runs
    are in the last partial state). ``cluster``: the scale's cluster section; where it gives the GPU's
    memory and the anchors, a plan that would not fit is refused before anything is built
    (:func:`memory_plan`). A method that runs out of GPU memory raises :class:`MethodFailed`."""
    timing = _Protocol(spec, data, log, on_repeat, partial, on_run)
    plans = timing.plan_sizes()
    timing.check_memory(plans, cluster)
    for plan in plans:
        timing.time_size(plan)
    return timing.finish()


class _Size:
    """What the protocol keeps while it times one size: its methods' values by repeat, their models
    (built once), the shared starting weights of the current repeat and the cached token batches."""

    def __init__(self, plan: dict, s: dict, spent_before: float):
        self.preset, self.methods, self.vocab = plan["preset"], plan["methods"], plan["vocab"]
        self.eot, self.accum, self.base = plan["eot"], plan["accum"], plan["repeats"]
        self.tokens_per_update = self.accum * s["micro_batch"] * s["seq_len"]
        self.target, self.budget = s["target_half_width"], for_preset(s, "budget_s", self.preset)
        self.num, self.den = _pair(s)
        self.per_rep: dict[str, dict[int, float]] = {m: {} for m in self.methods}
        self.slots: dict[str, MethodSlot] = {}
        self.shared, self.shared_rep, self.batches = None, None, None
        self.spent0, self.t_pre = spent_before, time.perf_counter()
        self.why_stopped = None


class _Protocol:
    """The protocol over sizes, repeats and methods in rotation (:func:`run`), with the result it
    builds and the partial state (:meth:`state`) it hands ``on_run``."""

    def __init__(self, spec: dict, data: str | None, log, on_repeat, partial: dict | None, on_run):
        import torch

        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_repeat, self.on_run = on_repeat, on_run
        self.started = now()
        self.t_start = time.perf_counter()
        self.s = s = resolve_spec(spec)
        deadline.deadline()  # a malformed LRATTNRES_DEADLINE stops here, before any work
        self.device = resolve_device(s["device"], where="throughput spec key 'device'")
        threads = 1 if (s["threads"] == "auto" and self.device.type == "cpu") else s["threads"]
        if is_int(threads):
            torch.set_num_threads(threads)
        self.precision = s["precision"] if s["precision"] != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        self.fla_ok, self.fla_note = fla_available(self.device.type)
        self.manifest = None
        if data and s["tokens"] == "data":
            self.manifest = load_manifest(data, verify="size")
        self.done = {(r["preset"], r["repeat"], r["name"]): r for r in (partial or {}).get("runs", [])}
        self.dropped = {p: list(v) for p, v in (partial or {}).get("dropped", {}).items()}
        self.spent: dict[str, float] = dict((partial or {}).get("spent_s", {}))
        self.process = f"{os.getpid()}@{self.started}"
        self.result = self._new_result(data, partial)

    def _new_result(self, data: str | None, partial: dict | None) -> dict[str, Any]:
        import torch

        s, device = self.s, self.device
        result: dict[str, Any] = {
            "stage": "throughput", "device": gpu_name(device), "device_type": device.type, "spec": s,
            "precision": self.precision, "compile": s["compile"], "threads": torch.get_num_threads(),
            "tokens": ("data: " + str(data)) if self.manifest is not None else
            f"synthetic (log-normal documents, median {s['doc_len_median']})",
            "fla": {"available": self.fla_ok, "note": self.fla_note},
            "rows": [], "gains": {}, "runs": [], "skipped": list((partial or {}).get("skipped", [])), "complete": False,
            "resolution": {}, "spent_s": self.spent,
            "notes": [
                "95% intervals use t_{0.975,n-1} s/sqrt(n); the paper's Appendix I prints s_g/5 (a typo: the "
                "standard error of a mean of five is s/sqrt(5)).",
            ],
        }
        if self.done:
            result["notes"].append(f"{len(self.done)} timed runs of an earlier, unfinished process taken as they were "
                                   f"(resumed {self.started})")
        if s["compile"]:
            result["notes"].append("torch.compile(dynamic=False) of the loss module, once per method and process: the "
                                   "repeats of a method in one process share its compiled graph (each loads its shared "
                                   "starting weights and starts a fresh optimiser); compilation happens in the first "
                                   "warm-up update, outside the timed region.")
        else:
            result["notes"].append("eager mode (compile false): the paper times compiled models (fullgraph=True).")
        return result

    def state(self) -> dict:
        """The partial state: what a later process continues."""
        result = self.result
        return {"runs": list(result["runs"]), "skipped": list(result["skipped"]), "dropped": dict(self.dropped),
                "spent_s": dict(self.spent)}

    def _keep_state(self) -> None:
        if self.on_run is not None:
            self.on_run(self.state())

    def plan_sizes(self) -> list[dict]:
        """The plan of every size (its methods, vocabulary, accumulation and repeats), before anything is built."""
        s, result, plans = self.s, self.result, []
        for preset in s["presets"]:
            methods = list(s["methods_by_preset"].get(preset, s["methods"]))
            if "fla-rd" in methods and not self.fla_ok:
                methods.remove("fla-rd")
                if not any(x["preset"] == preset and x["method"] == "fla-rd" for x in result["skipped"]):
                    result["skipped"].append({"preset": preset, "method": "fla-rd", "why": self.fla_note})
                self.say(f"[throughput] {preset}: fla-rd skipped: {self.fla_note}")
            methods = [m for m in methods if m not in self.dropped.get(preset, [])]
            if not methods:
                continue
            p = get_preset(preset)
            if self.manifest is not None:
                vocab, eot = int(self.manifest["vocab_size"]), int(self.manifest["eot_id"])
            else:
                vocab = s["vocab_size"] or p["vocab_size"] or SMALL_VOCAB
                eot = 100257 if vocab == PAPER_VOCAB else vocab - 1
            plans.append({"preset": preset, "methods": methods, "vocab": vocab, "eot": eot,
                          "accum": s["grad_accum_by_preset"].get(preset, s["grad_accum"]),
                          "repeats": s["repeats_by_preset"].get(preset, s["repeats"])})
        return plans

    def check_memory(self, plans: list[dict], cluster: dict | None) -> None:
        """The plan's estimated memory (:func:`memory_plan`): refused before anything is built where it does not fit."""
        result = self.result
        result["memory"] = memory_plan(plans, self.s, cluster, self.device)
        if result["memory"]["checked"]:
            worst = max(result["memory"]["rows"], key=lambda r: r["peak_gib"])
            self.say(f"[throughput] memory: at most {worst['peak_gib']:.1f} GiB estimated ({worst['preset']} "
                     f"{worst['method']}) of {result['memory']['limit_gib']:.1f} GiB")

    def _fail(self, what: str, e: BaseException) -> MethodFailed:
        self._keep_state()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return MethodFailed(f"{what} ran out of GPU memory ({first}); the job fails rather than drop it from "
                            "the comparison (the finished runs are kept in the partial state)")

    def _tokens(self, z: _Size) -> list:
        """The size's batches of every timed update: the data's first ones, or synthetic documents."""
        s = self.s
        if self.manifest is not None:
            return data_buffer(self.manifest, z.accum, s["micro_batch"], s["seq_len"], s["seed"])
        return synthetic_buffer(z.accum, s["micro_batch"], s["seq_len"], z.vocab, z.eot, s["doc_len_median"], s["seed"])

    def _spend(self, z: _Size) -> None:
        self.spent[z.preset] = z.spent0 + time.perf_counter() - z.t_pre

    # ---- one size

    def time_size(self, plan: dict) -> None:
        """Every repeat of one size: the base repeats of every method, then the resolved gain's two
        methods until its interval is narrow enough, the repeats or the budget are spent."""
        s, result = self.s, self.result
        z = _Size(plan, s, self.spent.get(plan["preset"], 0.0))
        self._announce(z)
        rows_meta = self._row_meta(z)
        j = 0
        while True:
            self._spend(z)
            rep_methods = self._repeat_methods(z, j)
            if rep_methods is None:
                break
            t_rep = time.perf_counter()
            got, failed = self._time_repeat(z, j, rep_methods)
            for name in failed:
                if name in z.methods:
                    z.methods.remove(name)
                z.per_rep.pop(name, None)
                z.slots.pop(name, None)
            if not z.methods:
                break
            self._record_repeat(z, j, got, rows_meta, t_rep)
            j += 1
        self._spend(z)
        preset = z.preset
        del z.slots, z.shared, z.batches
        _free(self.device)
        if not any(r["preset"] == preset for r in result["rows"]):
            if z.why_stopped != "deadline":
                raise MethodFailed(f"{preset}: every method failed ({', '.join(self.dropped.get(preset, []))}); no row "
                                   "to report (see the skipped list in the partial state)")
            return
        g = result["gains"].get(preset, {}).get(s["resolve_gain"])
        result["resolution"][preset] = {
            "gain": s["resolve_gain"], "target_half_width": z.target, "half_width": (g or {}).get("half_width"),
            "n": (g or {}).get("n"), "stopped": z.why_stopped, "spent_s": self.spent[preset], "budget_s": z.budget,
            "base_repeats": z.base, "max_repeats": s["max_repeats"]}

    def _announce(self, z: _Size) -> None:
        s = self.s
        self.say(f"[throughput] {z.preset}: methods {z.methods}, {z.base} repeats"
                 + (f" (then {z.num} / {z.den} until its half-width <= {z.target} points, {s['max_repeats']} repeats "
                    f"or {z.budget or 'no'} s)" if z.target is not None else "")
                 + f", {z.tokens_per_update} tokens per update ({s['micro_batch']} x {s['seq_len']} x {z.accum}), "
                 f"device {self.result['device']}, {self.precision}, compile {s['compile']}")

    def _row_meta(self, z: _Size) -> dict[str, dict]:
        """What each method's row of the size says besides its values."""
        s, d = self.s, get_preset(z.preset)["d_model"]
        rows_meta = {}
        for name in z.methods:
            cfg = method_config(z.preset, name, s, z.vocab)
            rows_meta[name] = {"preset": z.preset, "size": PAPER_SIZES.get(z.preset, z.preset), "name": name,
                               "method": METHOD_TABLE[name]["method"], "impl": METHOD_TABLE[name]["impl"],
                               "r": cfg.get("rank"), "d": d, "N": cfg.get("blocks"),
                               "tokens_per_update": z.tokens_per_update, "grad_accum": z.accum,
                               "micro_batch": s["micro_batch"], "seq_len": s["seq_len"]}
        return rows_meta

    def _repeat_methods(self, z: _Size, j: int) -> list[str] | None:
        """The methods repeat ``j`` times, or None where the size stops (``z.why_stopped`` says why):
        its extra repeats are done, the resolved gain lost a method, or the size's deadline passed."""
        s, result = self.s, self.result
        replay = any((z.preset, j, m) in self.done for m in METHOD_TABLE)
        if j >= z.base and not replay:
            pair_runs = [r for r in result["runs"] if r["preset"] == z.preset and r["name"] in (z.num, z.den)]
            parts = [run_estimate([r for r in pair_runs if r["name"] == m], m in z.slots) for m in (z.num, z.den)]
            go, why = more_repeats(result["gains"].get(z.preset, {}).get(s["resolve_gain"]), done=j, base=z.base,
                                   target=z.target, max_repeats=s["max_repeats"], spent_s=self.spent[z.preset],
                                   next_s=None if None in parts else sum(parts), budget_s=z.budget)
            if not go:
                z.why_stopped = why
                return None
        rep_methods = z.methods if j < z.base else [m for m in z.methods if m in (z.num, z.den)]
        if j >= z.base and len(rep_methods) < 2:
            z.why_stopped = f"{z.num} or {z.den} is not timed"
            return None
        dl = for_preset(s, "deadline_s", z.preset)
        if dl and time.perf_counter() - self.t_start > dl:
            result["notes"].append(f"deadline {dl:g} s reached: {z.preset} stopped after {j} of {z.base} repeats")
            self.say(f"[throughput] deadline {dl:g} s reached before {z.preset} repeat {j}")
            result["cut"] = True
            z.why_stopped = "deadline"
            return None
        return rep_methods

    def _time_repeat(self, z: _Size, j: int, rep_methods: list[str]) -> tuple[dict[str, float], set[str]]:
        """Repeat ``j``: each method in rotation, timed here or taken from an earlier process;
        ({method: tokens/s}, the methods that failed and are dropped)."""
        got: dict[str, float] = {}
        failed: set[str] = set()
        for pos, name in enumerate(rotation(rep_methods, j)):
            earlier = self.done.get((z.preset, j, name))
            if earlier is not None:  # timed by an earlier process
                got[name] = earlier["tokens_per_s"]
                self.result["runs"].append(earlier)
                continue
            rec = self._timed_run(z, j, name)
            if rec is None:
                failed.add(name)
                continue
            got[name] = self._record_run(z, j, pos, name, rec)
        return got, failed

    def _timed_run(self, z: _Size, j: int, name: str) -> dict | None:
        """One timed run of ``name`` in repeat ``j`` (its record), or None where it failed and is
        dropped from the comparison (and said so). A run that would not end before LRATTNRES_DEADLINE
        does not start; running out of GPU memory fails the job (:class:`MethodFailed`)."""
        result, device, preset = self.result, self.device, z.preset
        est = run_estimate([r for r in result["runs"] if r["preset"] == preset],
                           name in z.slots and z.slots[name].runs > 0)
        if est is not None:
            try:
                deadline.check(est, f"{preset} repeat {j} {name}")
            except deadline.DeadlineReached:
                self._spend(z)
                self._keep_state()
                raise
        slot = None
        try:
            if z.batches is None:
                z.batches = self._tokens(z)
            if z.shared_rep != j:
                try:
                    z.shared = shared_backbone(preset, self.s, z.vocab, j, device, into=z.shared)
                except Exception as e:
                    if out_of_memory(e):
                        raise self._fail(f"{preset}: the shared starting weights of repeat {j}", e) from None
                    raise
                z.shared_rep = j
            if name not in z.slots:
                z.slots[name] = MethodSlot(preset, name, self.s, z.vocab, device, self.precision)
            slot = z.slots[name]
            slot.load(z.shared)
            rec = time_method(slot.model, z.batches, self.s, device, self.precision, log=self.say, fwd=slot.fwd,
                              lm=slot.lm, guard=lambda sec, n=name: deadline.check(
                                  1.05 * sec, f"{preset} repeat {j} {n}: the next update"))
            slot.runs += 1
            return rec
        except deadline.DeadlineReached:
            self._spend(z)
            self._keep_state()
            raise
        except MethodFailed:
            raise
        except Exception as e:  # an unsupported shape, a peer's error: dropped, and said so
            if out_of_memory(e):
                self._spend(z)
                raise self._fail(f"{preset} repeat {j} method {name}", e) from None
            why = f"{type(e).__name__}: {str(e)[:500]}"
            self.say(f"[throughput] {preset} repeat {j} {name} FAILED, dropped from the comparison: {why}")
            result["skipped"].append({"preset": preset, "method": name, "why": f"failed in repeat {j}: {why}"})
            self.dropped.setdefault(preset, []).append(name)
            self._keep_state()
            return None
        finally:
            if slot is not None:
                slot.release()
            _free(device)

    def _record_run(self, z: _Size, j: int, pos: int, name: str, rec: dict) -> float:
        """A finished timed run in the result and the partial state; its tokens per second."""
        n = len(rec["times_s"])
        v = z.tokens_per_update * n / sum(rec["times_s"])
        self.result["runs"].append({"preset": z.preset, "repeat": j, "position": pos, "name": name,
                                    "tokens_per_s": v, "updates": n, "process": self.process, **rec})
        self._spend(z)
        self.say(f"[throughput] {z.preset} repeat {j} #{pos} {name}: {v:,.0f} tokens/s over {n} updates "
                 f"({rec['stopped']}; warm-up {rec['warmup_s']:.1f} s"
                 + (f", {rec['graphs_compiled']} graphs compiled, about {rec['compile_s']:.0f} s"
                    if rec.get("graphs_compiled") else "")
                 + ")")
        self._keep_state()
        return v

    def _record_repeat(self, z: _Size, j: int, got: dict[str, float], rows_meta: dict, t_rep: float) -> None:
        """The size's rows, gains and the claims after repeat ``j``."""
        s, result, preset = self.s, self.result, z.preset
        for name, v in got.items():
            if name in z.per_rep:
                z.per_rep[name][j] = v
        result["rows"] = [r for r in result["rows"] if r["preset"] != preset] + [
            _row(rows_meta[m], [z.per_rep[m][k] for k in sorted(z.per_rep[m])]) for m in z.methods if z.per_rep[m]]
        result["gains"][preset] = _gains(z.per_rep)
        result["claims"] = claims_for(result, s)
        result["elapsed_s"] = time.perf_counter() - self.t_start
        g = result["gains"][preset].get(s["resolve_gain"])
        self.say(f"[throughput] {preset} repeat {j} done in {time.perf_counter() - t_rep:.1f} s"
                 + "".join(f"; {gn} {gv['per_repeat'][-1]:+.2f}%" for gn, gv in result["gains"][preset].items())
                 + (f"; {s['resolve_gain']} half-width {g['half_width']:.3f} points over {g['n']} repeats"
                    if g and g.get("half_width") is not None else ""))
        if self.on_repeat is not None:
            self.on_repeat(result)

    def finish(self) -> dict:
        """The complete result: claims, provenance and the protocol's comparison with the paper's."""
        from lrattnres.attention import describe as describe_attention

        s, result = self.s, self.result
        result["complete"] = not result.get("cut", False)
        result["claims"] = claims_for(result, s)
        result["elapsed_s"] = time.perf_counter() - self.t_start
        result["provenance"] = provenance(s, started=self.started, attention=describe_attention(s["attention"], self.device))
        result["protocol"] = compare(result)
        return result


def _row(meta: dict, values: list[float]) -> dict:
    st = mean_ci95(values)
    return {**meta, "repeats": list(values), "mean": st["mean"], "sd": st["sd"]}


def _by_repeat(values) -> dict[int, float] | None:
    if values is None:
        return None
    return dict(values) if isinstance(values, dict) else dict(enumerate(values))


def _gains(per_method: dict) -> dict[str, dict]:
    """Paired gains over the repeats both methods have (``per_method``: name -> values by repeat, as a
    dict or a list in repeat order)."""
    out = {}
    for gname, num, den in GAINS:
        a, b = _by_repeat(per_method.get(num)), _by_repeat(per_method.get(den))
        if not a or not b:
            continue
        common = sorted(set(a) & set(b))
        if common:
            out[gname] = {"numerator": num, "denominator": den, "repeat_ids": common,
                          **paired_gain([a[k] for k in common], [b[k] for k in common])}
    return out
