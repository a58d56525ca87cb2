"""The measurement: one timed run of a method (warm-up, then the trainer's updates until the stopping
rule), and the protocol over presets, repeats and methods in rotation, with the rows and gains of
the result."""

from __future__ import annotations

import copy
import gc
import math
import sys
import time
from typing import Any, Callable

from lrattnres.checks import is_int
from lrattnres.devices import resolve_device
from lrattnres.throughput.matched import (data_buffer, fla_available, matched_model, method_config, shared_backbone,
                                          synthetic_buffer)
from lrattnres.throughput.protocol import mean_ci95, paired_gain, should_stop
from lrattnres.throughput.spec import GAINS, METHOD_TABLE, PAPER_SIZES, SMALL_VOCAB, resolve_spec
from lrattnres.throughput.summary import claims_for


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_spec() -> dict:
    from lrattnres.train import spec as train_spec

    return copy.deepcopy(train_spec.DEFAULTS)


def time_method(model, batches: list, s: dict, device, precision: str, log=None,
                guard: Callable[[float], None] | None = None) -> dict:
    """Warm-up updates, then measured updates until :func:`should_stop`; returns the times.

    Each update is the trainer's: ``accumulate_gradients`` (transfer, forward, backward over the
    micro-batches, clipping) then ``apply_update`` (Muon + AdamW, zero_grad), with the device
    synchronised before and after; nothing else is inside the timed region. ``guard(seconds)`` is
    called before every update after the first with the last update's duration (it raises to stop:
    the deadline, lrattnres/deadline.py).
    """
    import torch

    from lrattnres.train.loop import LossModule, accumulate_gradients, apply_update
    from lrattnres.train.optim import build_optimizers

    ts = _train_spec()
    lm = LossModule(model, precision)
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

    gc.collect()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    last = None
    for _ in range(s["warmup"]):
        if guard is not None and last is not None:
            guard(last)
        t = time.perf_counter()
        update()
        _sync(device)
        last = time.perf_counter() - t
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
    del optimizers, fwd, lm
    return {"times_s": times, "warmup_s": warm_s, "stopped": why, "final_ce": ce, "peak_mem_gib": peak,
            "weights_dtype": wdtype}


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
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


def run(spec: dict, data: str | None = None, log=None, on_repeat: Callable[[dict], None] | None = None,
        partial: dict | None = None, on_run: Callable[[dict], None] | None = None) -> dict:
    """Run the protocol; returns the result dict (``on_repeat`` gets the partial result after every repeat).

    ``partial``: the state of an earlier, unfinished run of the same spec (:func:`partial_state`):
    its timed runs are taken as they are and only the missing ones are timed (the matched weights of
    a repeat are a function of the seed and the repeat, so a repeat may be finished by another
    process). ``on_run`` gets the partial state after every timed run. With ``LRATTNRES_DEADLINE``
    set, no run starts that would not end before it, and a run under way stops between updates:
    :class:`lrattnres.deadline.DeadlineReached` (the finished runs are in the last partial state)."""
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

    result: dict[str, Any] = {
        "stage": "throughput", "device": gpu_name(device), "device_type": device.type, "spec": s,
        "precision": precision, "compile": s["compile"], "threads": torch.get_num_threads(),
        "tokens": ("data: " + str(data)) if manifest is not None else
        f"synthetic (log-normal documents, median {s['doc_len_median']})",
        "fla": {"available": fla_ok, "note": fla_note},
        "rows": [], "gains": {}, "runs": [], "skipped": list((partial or {}).get("skipped", [])), "complete": False,
        "notes": [
            "95% intervals use t_{0.975,n-1} s/sqrt(n); the paper's Appendix I prints s_g/5 (a typo: the "
            "standard error of a mean of five is s/sqrt(5)).",
        ],
    }
    if done:
        result["notes"].append(f"{len(done)} timed runs of an earlier, unfinished process taken as they were "
                               f"(resumed {started})")
    if s["compile"]:
        result["notes"].append("torch.compile(dynamic=False) of the loss module; compilation happens in the warm-up updates.")
    else:
        result["notes"].append("eager mode (compile false): the paper times compiled models (fullgraph=True).")

    def state() -> dict:
        return {"runs": list(result["runs"]), "skipped": list(result["skipped"]), "dropped": dict(dropped)}

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
        accum = s["grad_accum_by_preset"].get(preset, s["grad_accum"])
        repeats = s["repeats_by_preset"].get(preset, s["repeats"])
        batches = None

        def cached_tokens():
            if manifest is not None:
                return data_buffer(manifest, accum, s["micro_batch"], s["seq_len"], s["seed"])
            return synthetic_buffer(accum, s["micro_batch"], s["seq_len"], vocab, eot, s["doc_len_median"], s["seed"])

        tokens_per_update = accum * s["micro_batch"] * s["seq_len"]
        d = p["d_model"]
        say(f"[throughput] {preset}: methods {methods}, {repeats} repeats, {tokens_per_update} tokens per update "
            f"({s['micro_batch']} x {s['seq_len']} x {accum}), device {result['device']}, {precision}, "
            f"compile {s['compile']}")
        per_method: dict[str, list[float]] = {m: [] for m in methods}
        rows_meta = {}
        for name in methods:
            cfg = method_config(preset, name, s, vocab)
            rows_meta[name] = {"preset": preset, "size": PAPER_SIZES.get(preset, preset), "name": name,
                               "method": METHOD_TABLE[name]["method"], "impl": METHOD_TABLE[name]["impl"],
                               "r": cfg.get("rank"), "d": d, "N": cfg.get("blocks"),
                               "tokens_per_update": tokens_per_update, "grad_accum": accum,
                               "micro_batch": s["micro_batch"], "seq_len": s["seq_len"]}
        dl = s["deadline_s"].get(preset) if isinstance(s["deadline_s"], dict) else s["deadline_s"]
        failed: set[str] = set()
        for j in range(repeats):
            if dl and time.perf_counter() - t_start > dl:
                result["notes"].append(f"deadline {dl:g} s reached: {preset} stopped after {j} of {repeats} repeats")
                say(f"[throughput] deadline {dl:g} s reached before {preset} repeat {j}")
                result["cut"] = True
                break
            t_rep = time.perf_counter()
            shared = None
            got: dict[str, float] = {}
            for pos, name in enumerate(rotation(methods, j)):
                earlier = done.get((preset, j, name))
                if earlier is not None:  # timed by an earlier process
                    got[name] = earlier["tokens_per_s"]
                    result["runs"].append(earlier)
                    continue
                # a run that would not end before LRATTNRES_DEADLINE does not start (the longest one so far)
                took = [r["warmup_s"] + sum(r["times_s"]) for r in result["runs"] if r["preset"] == preset]
                if took:
                    deadline.check(max(took), f"{preset} repeat {j} {name}")
                model = None
                try:
                    if batches is None:
                        batches = cached_tokens()
                    if shared is None:
                        shared = shared_backbone(preset, s, vocab, j, device)
                    model = matched_model(preset, name, s, vocab, shared, device)
                    model.train()
                    rec = time_method(model, batches, s, device, precision, log=say,
                                      guard=lambda sec, n=name: deadline.check(1.05 * sec, f"{preset} repeat {j} {n}: the next update"))
                except deadline.DeadlineReached:
                    raise
                except Exception as e:  # one failing method (an unsupported shape, OOM) must not end the run
                    why = f"{type(e).__name__}: {str(e)[:500]}"
                    say(f"[throughput] {preset} repeat {j} {name} FAILED, dropped from the comparison: {why}")
                    result["skipped"].append({"preset": preset, "method": name, "why": f"failed in repeat {j}: {why}"})
                    failed.add(name)
                    dropped.setdefault(preset, []).append(name)
                    if on_run is not None:
                        on_run(state())
                    continue
                finally:
                    del model
                    _free(device)
                n = len(rec["times_s"])
                v = tokens_per_update * n / sum(rec["times_s"])
                got[name] = v
                result["runs"].append({"preset": preset, "repeat": j, "position": pos, "name": name,
                                       "tokens_per_s": v, "updates": n, **rec})
                say(f"[throughput] {preset} repeat {j} #{pos} {name}: {v:,.0f} tokens/s over {n} updates "
                    f"({rec['stopped']}; warm-up {rec['warmup_s']:.1f} s)")
                if on_run is not None:
                    on_run(state())
            del shared
            _free(device)
            for name in failed:
                if name in methods:
                    methods.remove(name)
                per_method.pop(name, None)
            failed.clear()
            if not methods:
                break
            for name, v in got.items():
                if name in per_method:
                    per_method[name].append(v)
            result["rows"] = [r for r in result["rows"] if r["preset"] != preset] + [
                _row(rows_meta[m], per_method[m]) for m in methods]
            result["gains"][preset] = _gains(per_method)
            result["claims"] = claims_for(result, s)
            result["elapsed_s"] = time.perf_counter() - t_start
            say(f"[throughput] {preset} repeat {j} done in {time.perf_counter() - t_rep:.1f} s"
                + "".join(f"; {g} {v['per_repeat'][-1]:+.2f}%" for g, v in result["gains"][preset].items()))
            if on_repeat is not None:
                on_repeat(result)
        del batches
    result["complete"] = not result.get("cut", False)
    result["claims"] = claims_for(result, s)
    result["elapsed_s"] = time.perf_counter() - t_start
    from lrattnres.attention import describe as describe_attention

    result["provenance"] = provenance(s, started=started, attention=describe_attention(s["attention"], device))
    return result


def _row(meta: dict, values: list[float]) -> dict:
    st = mean_ci95(values)
    return {**meta, "repeats": list(values), "mean": st["mean"], "sd": st["sd"]}


def _gains(per_method: dict[str, list[float]]) -> dict[str, dict]:
    out = {}
    for gname, num, den in GAINS:
        if num in per_method and den in per_method and per_method[num] and len(per_method[num]) == len(per_method[den]):
            out[gname] = {"numerator": num, "denominator": den, **paired_gain(per_method[num], per_method[den])}
    return out
