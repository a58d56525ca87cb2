"""Host time per call of ``kernels.attnres``: how much the Python side costs around the two kernels.

    python benchmarks/host_overhead.py [--out DIR] [--S 9 --d 1536 --r 384 --tokens 64] [--cprofile]

Why: called eagerly (no torch.compile, or a model whose step the host cannot run ahead of), the
time of one read is max(host time, GPU time).  The H200 run of 2026-11-29 measured eager
forward+backward at 1.2-1.7 ms against 0.3 ms of GPU time (CUDA-graph replay) at d=1536, S=9:
host-bound (docs/kernel.md).

It times, per forward+backward (and per forward), a loop of calls at a token count so small that the
GPU work is negligible:
  op        the torch.library custom op with its registered autograd (what torch.compile traces)
  function  the eager path of ``kernels.attnres``: a plain autograd.Function over the same kernels
  launchers ``kernels.launch.fwd`` + ``bwd`` alone (no autograd)
On a CUDA machine the kernels launch for real; on a CPU the two Triton launches are replaced by
no-ops (the Triton interpreter would time the interpreter), so the CPU numbers are the Python and
dispatch cost only, without Triton's own launch cost.  With --cprofile it also lists, for the launchers
and for the op, the functions with the most own time per call (cProfile).  Writes host_overhead.json
to --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kernels  # noqa: E402
import kernels.autograd as autograd  # noqa: E402
import kernels.launch as launch  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel on a CPU: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_launches() -> None:
    """On a CPU: the launchers' host work, every kernel launch a no-op."""
    launch._run = lambda kernel, grid, warm, *args, **kwargs: _NoLaunch()


def _time_per_call(fn, sync, n: int, rounds: int) -> dict:
    for _ in range(20):
        fn()
    sync()
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        per.append((time.perf_counter() - t) / n * 1e6)
    return {"median_us": statistics.median(per), "min_us": min(per), "rounds_us": per}


def cprofile_top(fn, calls: int, top: int = 25) -> list[dict]:
    """``fn`` called ``calls`` times under cProfile: the functions with the most own time, per call
    of ``fn`` (us) -- where the host time of a launch goes (our Python, torch's dispatch, Triton's
    launcher, the CUDA driver)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{os.path.basename(k[0])}:{k[1]}({k[2]})", "calls_per_call": v[1] / calls,
             "own_us_per_call": v[2] / calls * 1e6, "cumulative_us_per_call": v[3] / calls * 1e6} for k, v in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--S", type=int, default=9)
    p.add_argument("--d", type=int, default=1536)
    p.add_argument("--r", type=int, default=384)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cprofile", action="store_true", help="also profile the launchers and the op under cProfile")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if not cuda:
        _stub_launches()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    srcs = [torch.randn(a.tokens, a.d, device=dev, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(a.S)]
    q = torch.randn(a.r, device=dev, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(a.tokens, a.d, device=dev, generator=gen).to(torch.bfloat16)
    leaves = srcs + [q]

    s = kernels.DEFAULT if cuda else kernels.DEFAULT.replace(cpu_triton=True, dq_sum="torch")

    def op_fwd():
        return kernels.attnres_fwd(srcs, q, "slice", 1e-6, s.key)[0]

    def fn_fwd():
        return autograd._AttnResTriton.apply(q, "slice", 1e-6, s, *srcs)

    def op_fb():
        return torch.autograd.grad(op_fwd(), leaves, g)

    def fn_fb():
        return torch.autograd.grad(fn_fwd(), leaves, g)

    def launch_fb():
        h, lse, res = launch.fwd(srcs, q, "slice", 1e-6, s)
        return launch.bwd(srcs, q, h, lse, res, g, "slice", 1e-6, s)

    rows = {}
    for name, fn in (("op fwd", op_fwd), ("function fwd", fn_fwd), ("op fwd+bwd", op_fb),
                     ("function fwd+bwd", fn_fb), ("launchers fwd+bwd", launch_fb)):
        rows[name] = _time_per_call(fn, sync, a.calls, a.rounds)
        print(f"{name:>18}: {rows[name]['median_us']:8.1f} us per call (median of {a.rounds} rounds)", flush=True)
    profiles = {}
    if a.cprofile:
        for name, fn in (("launchers fwd+bwd", launch_fb), ("op fwd+bwd", op_fb)):
            profiles[name] = cprofile_top(fn, a.calls)
            sync()
            print(f"cProfile, {name}: " + "; ".join(f"{r['function']} {r['own_us_per_call']:.1f} us"
                                                    for r in profiles[name][:8]), flush=True)
    doc = {
        "benchmark": "host_overhead", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else f"cpu: {platform.processor() or platform.machine()}",
        "launches": "real" if cuda else "stubbed (no-op): Python and dispatch cost only",
        "torch": torch.__version__, "settings": vars(a), "rows": rows,
    }
    if profiles:
        doc["cprofile"] = profiles
    if a.out:
        from lrattnres.io import atomic_write_json

        atomic_write_json(os.path.join(a.out, "host_overhead.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
