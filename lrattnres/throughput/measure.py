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

from lrattnres.checks import is_int
from lrattnres.devices import resolve_device
from lrattnres.throughput.matched import (build_method_model, data_buffer, fla_available, load_shared,
                                          method_config, release_weights, shared_backbone, synthetic_buffer)
from lrattnres.throughput.protocol import mean_ci95, more_repeats, paired_gain, should_stop
from lrattnres.throughput.spec import GAINS, METHOD_TABLE, PAPER_SIZES, SMALL_VOCAB, for_preset, resolve_spec
from lrattnres.throughput.summary import claims_for

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

    from lrattnres.train import spec as train_spec

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
    from lrattnres import memory
    from lrattnres.presets import get_preset

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
    import torch

    from lrattnres import deadline
    from lrattnres.presets import PAPER_VOCAB, get_preset
    from lrattnres.provenance import now, provenance

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = now()
    t_start = time.perf_counter()
    s = resolve_spec(spec)
    deadline.deadline()  # a malformed LRATTNRES_DEADLINE stops here, before any work
    device = resolve_device(s["device"], where="throughput spec key 'device'")
    threads = 1 if (s["threads"] == "auto" and device.type == "cpu") else s["threads"]
    if is_int(threads):
        torch.set_num_threads(threads)
    precision = s["precision"] if s["precision"] != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    fla_ok, fla_note = fla_available(device.type)
    manifest = None
    if data and s["tokens"] == "data":
        from lrattnres.data import load_manifest

        manifest = load_manifest(data, verify="size")
    done = {(r["preset"], r["repeat"], r["name"]): r for r in (partial or {}).get("runs", [])}
    dropped = {p: list(v) for p, v in (partial or {}).get("dropped", {}).items()}
    spent: dict[str, float] = dict((partial or {}).get("spent_s", {}))
    process = f"{os.getpid()}@{started}"

    result: dict[str, Any] = {
        "stage": "throughput", "device": gpu_name(device), "device_type": device.type, "spec": s,
        "precision": precision, "compile": s["compile"], "threads": torch.get_num_threads(),
        "tokens": ("data: " + str(data)) if manifest is not None else
        f"synthetic (log-normal documents, median {s['doc_len_median']})",
        "fla": {"available": fla_ok, "note": fla_note},
        "rows": [], "gains": {}, "runs": [], "skipped": list((partial or {}).get("skipped", [])), "complete": False,
        "resolution": {}, "spent_s": spent,
        "notes": [
            "95% intervals use t_{0.975,n-1} s/sqrt(n); the paper's Appendix I prints s_g/5 (a typo: the "
            "standard error of a mean of five is s/sqrt(5)).",
        ],
    }
    if done:
        result["notes"].append(f"{len(done)} timed runs of an earlier, unfinished process taken as they were "
                               f"(resumed {started})")
    if s["compile"]:
        result["notes"].append("torch.compile(dynamic=False) of the loss module, once per method and process: the "
                               "repeats of a method in one process share its compiled graph (each loads its shared "
                               "starting weights and starts a fresh optimiser); compilation happens in the first "
                               "warm-up update, outside the timed region.")
    else:
        result["notes"].append("eager mode (compile false): the paper times compiled models (fullgraph=True).")

    def state() -> dict:
        return {"runs": list(result["runs"]), "skipped": list(result["skipped"]), "dropped": dict(dropped),
                "spent_s": dict(spent)}

    # ---- the plan of every size, and its memory, before anything is built
    plans = []
    for preset in s["presets"]:
        methods = list(s["methods_by_preset"].get(preset, s["methods"]))
        if "fla-rd" in methods and not fla_ok:
            methods.remove("fla-rd")
            if not any(x["preset"] == preset and x["method"] == "fla-rd" for x in result["skipped"]):
                result["skipped"].append({"preset": preset, "method": "fla-rd", "why": fla_note})
            say(f"[throughput] {preset}: fla-rd skipped: {fla_note}")
        methods = [m for m in methods if m not in dropped.get(preset, [])]
        if not methods:
            continue
        p = get_preset(preset)
        if manifest is not None:
            vocab, eot = int(manifest["vocab_size"]), int(manifest["eot_id"])
        else:
            vocab = s["vocab_size"] or p["vocab_size"] or SMALL_VOCAB
            eot = 100257 if vocab == PAPER_VOCAB else vocab - 1
        plans.append({"preset": preset, "methods": methods, "vocab": vocab, "eot": eot,
                      "accum": s["grad_accum_by_preset"].get(preset, s["grad_accum"]),
                      "repeats": s["repeats_by_preset"].get(preset, s["repeats"])})
    result["memory"] = memory_plan(plans, s, cluster, device)
    if result["memory"]["checked"]:
        worst = max(result["memory"]["rows"], key=lambda r: r["peak_gib"])
        say(f"[throughput] memory: at most {worst['peak_gib']:.1f} GiB estimated ({worst['preset']} {worst['method']}) "
            f"of {result['memory']['limit_gib']:.1f} GiB")

    def fail(what: str, e: BaseException) -> MethodFailed:
        if on_run is not None:
            on_run(state())
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return MethodFailed(f"{what} ran out of GPU memory ({first}); the job fails rather than drop it from "
                            "the comparison (the finished runs are kept in the partial state)")

    for plan in plans:
        preset, methods, vocab, accum, base = plan["preset"], plan["methods"], plan["vocab"], plan["accum"], plan["repeats"]
        batches = None

        def cached_tokens():
            if manifest is not None:
                return data_buffer(manifest, accum, s["micro_batch"], s["seq_len"], s["seed"])
            return synthetic_buffer(accum, s["micro_batch"], s["seq_len"], vocab, plan["eot"], s["doc_len_median"],
                                    s["seed"])

        tokens_per_update = accum * s["micro_batch"] * s["seq_len"]
        d = get_preset(preset)["d_model"]
        target, budget = s["target_half_width"], for_preset(s, "budget_s", preset)
        num, den = _pair(s)
        say(f"[throughput] {preset}: methods {methods}, {base} repeats"
            + (f" (then {num} / {den} until its half-width <= {target} points, {s['max_repeats']} repeats or "
               f"{budget or 'no'} s)" if target is not None else "")
            + f", {tokens_per_update} tokens per update ({s['micro_batch']} x {s['seq_len']} x {accum}), device "
            f"{result['device']}, {precision}, compile {s['compile']}")
        per_rep: dict[str, dict[int, float]] = {m: {} for m in methods}
        rows_meta = {}
        for name in methods:
            cfg = method_config(preset, name, s, vocab)
            rows_meta[name] = {"preset": preset, "size": PAPER_SIZES.get(preset, preset), "name": name,
                               "method": METHOD_TABLE[name]["method"], "impl": METHOD_TABLE[name]["impl"],
                               "r": cfg.get("rank"), "d": d, "N": cfg.get("blocks"),
                               "tokens_per_update": tokens_per_update, "grad_accum": accum,
                               "micro_batch": s["micro_batch"], "seq_len": s["seq_len"]}
        dl = for_preset(s, "deadline_s", preset)
        slots: dict[str, MethodSlot] = {}
        shared, shared_rep = None, None
        spent0, t_pre = spent.get(preset, 0.0), time.perf_counter()
        why_stopped = None
        j = 0
        while True:
            spent[preset] = spent0 + time.perf_counter() - t_pre
            replay = any((preset, j, m) in done for m in METHOD_TABLE)
            if j >= base and not replay:
                pair_runs = [r for r in result["runs"] if r["preset"] == preset and r["name"] in (num, den)]
                parts = [run_estimate([r for r in pair_runs if r["name"] == m], m in slots) for m in (num, den)]
                go, why = more_repeats(result["gains"].get(preset, {}).get(s["resolve_gain"]), done=j, base=base,
                                       target=target, max_repeats=s["max_repeats"], spent_s=spent[preset],
                                       next_s=None if None in parts else sum(parts), budget_s=budget)
                if not go:
                    why_stopped = why
                    break
            rep_methods = methods if j < base else [m for m in methods if m in (num, den)]
            if j >= base and len(rep_methods) < 2:
                why_stopped = f"{num} or {den} is not timed"
                break
            if dl and time.perf_counter() - t_start > dl:
                result["notes"].append(f"deadline {dl:g} s reached: {preset} stopped after {j} of {base} repeats")
                say(f"[throughput] deadline {dl:g} s reached before {preset} repeat {j}")
                result["cut"] = True
                why_stopped = "deadline"
                break
            t_rep = time.perf_counter()
            got: dict[str, float] = {}
            failed: set[str] = set()
            for pos, name in enumerate(rotation(rep_methods, j)):
                earlier = done.get((preset, j, name))
                if earlier is not None:  # timed by an earlier process
                    got[name] = earlier["tokens_per_s"]
                    result["runs"].append(earlier)
                    continue
                # a run that would not end before LRATTNRES_DEADLINE does not start
                est = run_estimate([r for r in result["runs"] if r["preset"] == preset],
                                   name in slots and slots[name].runs > 0)
                if est is not None:
                    try:
                        deadline.check(est, f"{preset} repeat {j} {name}")
                    except deadline.DeadlineReached:
                        spent[preset] = spent0 + time.perf_counter() - t_pre
                        if on_run is not None:
                            on_run(state())
                        raise
                slot = None
                try:
                    if batches is None:
                        batches = cached_tokens()
                    if shared_rep != j:
                        try:
                            shared = shared_backbone(preset, s, vocab, j, device, into=shared)
                        except Exception as e:
                            if out_of_memory(e):
                                raise fail(f"{preset}: the shared starting weights of repeat {j}", e) from None
                            raise
                        shared_rep = j
                    if name not in slots:
                        slots[name] = MethodSlot(preset, name, s, vocab, device, precision)
                    slot = slots[name]
                    slot.load(shared)
                    rec = time_method(slot.model, batches, s, device, precision, log=say, fwd=slot.fwd, lm=slot.lm,
                                      guard=lambda sec, n=name: deadline.check(
                                          1.05 * sec, f"{preset} repeat {j} {n}: the next update"))
                    slot.runs += 1
                except deadline.DeadlineReached:
                    spent[preset] = spent0 + time.perf_counter() - t_pre
                    if on_run is not None:
                        on_run(state())
                    raise
                except MethodFailed:
                    raise
                except Exception as e:  # an unsupported shape, a peer's error: dropped, and said so
                    if out_of_memory(e):
                        spent[preset] = spent0 + time.perf_counter() - t_pre
                        raise fail(f"{preset} repeat {j} method {name}", e) from None
                    why = f"{type(e).__name__}: {str(e)[:500]}"
                    say(f"[throughput] {preset} repeat {j} {name} FAILED, dropped from the comparison: {why}")
                    result["skipped"].append({"preset": preset, "method": name, "why": f"failed in repeat {j}: {why}"})
                    failed.add(name)
                    dropped.setdefault(preset, []).append(name)
                    if on_run is not None:
                        on_run(state())
                    continue
                finally:
                    if slot is not None:
                        slot.release()
                    _free(device)
                n = len(rec["times_s"])
                v = tokens_per_update * n / sum(rec["times_s"])
                got[name] = v
                result["runs"].append({"preset": preset, "repeat": j, "position": pos, "name": name,
                                       "tokens_per_s": v, "updates": n, "process": process, **rec})
                spent[preset] = spent0 + time.perf_counter() - t_pre
                say(f"[throughput] {preset} repeat {j} #{pos} {name}: {v:,.0f} tokens/s over {n} updates "
                    f"({rec['stopped']}; warm-up {rec['warmup_s']:.1f} s"
                    + (f", {rec['graphs_compiled']} graphs compiled, about {rec['compile_s']:.0f} s" if rec.get("graphs_compiled") else "")
                    + ")")
                if on_run is not None:
                    on_run(state())
            for name in failed:
                if name in methods:
                    methods.remove(name)
                per_rep.pop(name, None)
                slots.pop(name, None)
            if not methods:
                break
            for name, v in got.items():
                if name in per_rep:
                    per_rep[name][j] = v
            result["rows"] = [r for r in result["rows"] if r["preset"] != preset] + [
                _row(rows_meta[m], [per_rep[m][k] for k in sorted(per_rep[m])]) for m in methods if per_rep[m]]
            result["gains"][preset] = _gains(per_rep)
            result["claims"] = claims_for(result, s)
            result["elapsed_s"] = time.perf_counter() - t_start
            g = result["gains"][preset].get(s["resolve_gain"])
            say(f"[throughput] {preset} repeat {j} done in {time.perf_counter() - t_rep:.1f} s"
                + "".join(f"; {gn} {gv['per_repeat'][-1]:+.2f}%" for gn, gv in result["gains"][preset].items())
                + (f"; {s['resolve_gain']} half-width {g['half_width']:.3f} points over {g['n']} repeats"
                   if g and g.get("half_width") is not None else ""))
            if on_repeat is not None:
                on_repeat(result)
            j += 1
        spent[preset] = spent0 + time.perf_counter() - t_pre
        del slots, shared, batches
        _free(device)
        if not any(r["preset"] == preset for r in result["rows"]):
            if why_stopped != "deadline":
                raise MethodFailed(f"{preset}: every method failed ({', '.join(dropped.get(preset, []))}); no row "
                                   "to report (see the skipped list in the partial state)")
            continue
        g = result["gains"].get(preset, {}).get(s["resolve_gain"])
        result["resolution"][preset] = {
            "gain": s["resolve_gain"], "target_half_width": target, "half_width": (g or {}).get("half_width"),
            "n": (g or {}).get("n"), "stopped": why_stopped, "spent_s": spent[preset], "budget_s": budget,
            "base_repeats": base, "max_repeats": s["max_repeats"]}
    result["complete"] = not result.get("cut", False)
    result["claims"] = claims_for(result, s)
    result["elapsed_s"] = time.perf_counter() - t_start
    from lrattnres.attention import describe as describe_attention
    from lrattnres.throughput.comparison import compare

    result["provenance"] = provenance(s, started=started, attention=describe_attention(s["attention"], device))
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
