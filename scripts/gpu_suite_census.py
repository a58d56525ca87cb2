#!/usr/bin/env python3
"""What the GPU suite (scripts/run_gpu_tests.py) asks of a GPU, counted on a machine without one.

    python scripts/gpu_suite_census.py [--json OUT] [-- PYTEST_ARGS ...]

The suite is bound by building Triton kernels: every case of the kernel test files that asks for a
launch configuration, shape class or dtype not built before makes Triton compile one more
specialisation of a kernel.  This script gives:

- the suite's cases, per file and per test, and those marked ``gpu_alone``;
- the kernel specialisations its kernel cases request: it runs tests/test_kernels.py,
  test_kernels_naive.py and test_kernels_tuner.py with ``--gpu-suite`` on the CPU, records every
  Triton launch (Triton's interpreter: the kernel, its compile-time constants, its launch options,
  and its arguments as Triton specialises them: tensor dtype and 16-byte alignment, integers equal
  to 1 or divisible by 16), and counts the distinct ones.  The CPU cases run as usual through the
  interpreter.  The cases marked ``gpu`` run "dry": their skip marks are lifted, their bf16 checks
  build the same launches on small CPU tensors (the token count keeps its specialisation) and
  record them without running any kernel; with autotuning on, every distinct candidate of a shape
  class is recorded, as the tuner builds them all on a GPU.  A ``gpu`` case that needs CUDA
  tensors of its own, Inductor or subprocesses cannot run dry and is listed as not counted;
- per test, how many specialisations no other test asks for, and the cases whose every
  specialisation another case asks for too (a case that builds nothing of its own costs a GPU only
  its run).

A GPU builds each distinct specialisation once when every worker shares one Triton cache (two
workers may build the same one at once).  Multiply the count by the seconds one build takes
(benchmarks/offline_sass.py records them per kernel as ``build_s``) for the suite's compile time.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KERNEL_FILES = ("tests/test_kernels.py", "tests/test_kernels_naive.py", "tests/test_kernels_tuner.py")
DRY_LEAD = (2, 8)  # 16 tokens: a multiple of 16, as the bf16 checks' 1024 to 16384


def spec_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles one build for: the kernel, its constexpr values, launch options, and each
    other argument as specialised (dtype and 16-byte alignment of a tensor; an int's == 1 and
    divisibility by 16).  FUSED is taken as on a GPU (the interpreter builds without fused sums)."""
    names = list(kernel.arg_names)
    params = inspect.signature(kernel.fn).parameters
    given = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    parts = []
    for name in names:
        v = given.get(name, params[name].default)
        if "constexpr" in str(params[name].annotation):
            parts.append((name, "=", True if name == "FUSED" else repr(v)))
        elif hasattr(v, "data_ptr"):
            parts.append((name, str(v.dtype), v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or v is None:
            parts.append((name, repr(v)))
        elif isinstance(v, int):
            parts.append((name, "int", v == 1, v % 16 == 0))
        else:
            parts.append((name, type(v).__name__))
    opts = {"num_warps": 4, "num_stages": 3, **{k: v for k, v in kwargs.items() if k not in names}}
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}", tuple(parts), tuple(sorted(opts.items()))


class Census:
    """A pytest plugin: records the launches of every case, runs the ``gpu`` cases dry."""

    def __init__(self):
        self.specs: dict[tuple, set] = defaultdict(set)  # spec -> the tests (functions) that ask for it
        self.by_case: dict[tuple, set] = defaultdict(set)  # spec -> the cases that ask for it
        self.cases: Counter = Counter()  # test -> cases run
        self.not_counted: dict[str, str] = {}
        self.dry = False
        self.test = self.case = None

    def record(self, kernel, args, kwargs) -> None:
        key = spec_key(kernel, args, kwargs)
        self.specs[key].add(self.test)
        self.by_case[key].add(self.case)

    @contextlib.contextmanager
    def recording(self):
        from triton.runtime.interpreter import InterpretedFunction

        real = InterpretedFunction.run

        def run(kernel, *args, grid, warmup, **kwargs):
            self.record(kernel, args, kwargs)
            if self.dry or warmup:
                return None
            return real(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = real

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:  # the gpu cases run (dry): their CUDA skips lifted
            if item.get_closest_marker("gpu") is not None:
                item.own_markers[:] = [m for m in item.own_markers if m.name not in ("skip", "skipif")]

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        self.case = pyfuncitem.nodeid
        self.test = self.case.split("[")[0]
        self.cases[self.test] += 1
        if pyfuncitem.get_closest_marker("gpu") is None:
            return None  # pytest runs it (through the interpreter), launches recorded
        args = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
        with _dry(self, pyfuncitem.module):
            try:
                pyfuncitem.obj(**args)
            except Exception as e:  # noqa: BLE001 - what a dry run cannot do is reported, not failed
                first = str(e).splitlines()[0][:160] if str(e) else ""
                self.not_counted[pyfuncitem.nodeid] = f"{type(e).__name__}: {first}"
        return True


@contextlib.contextmanager
def _dry(census: Census, module):
    """The gpu cases' launches built on the CPU and recorded, none run."""
    import torch

    from kernels import configs, dispatch, tuner

    real_check, real_choose, real_sum = getattr(module, "bf16_check", None), dispatch.choose, dispatch.sum_method
    real_sync = torch.cuda.synchronize

    def bf16_check(d, r, S, norm, tokens=2048, layout="contig", seed=0, fn=None, s=None):
        """tests/test_kernels.bf16_check's launches: the forward and backward of ``fn`` and the
        custom op's forward, on DRY_LEAD tokens."""
        import kernels

        s = (s or module._settings()).replace(cpu_triton=True)
        gen = torch.Generator().manual_seed(seed)
        sources = module._make_sources(S, DRY_LEAD, d, torch.bfloat16, "cpu", layout, gen)
        query = (torch.randn(r, generator=gen) * 0.5).requires_grad_()
        g = torch.randn(*DRY_LEAD, d, generator=gen).to(torch.bfloat16)
        h = (fn or kernels.attnres)(sources, query, norm=norm, settings=s)
        torch.autograd.grad(h, [*sources, query], g)
        kernels.attnres_fwd(sources, query, norm, 1e-6, s.key)
        return {"out_rel_l2": 0.0, "src_grad_rel_l2": 0.0, "query_grad_rel_l2": 0.0}

    tuned = set()

    def choose(kind, block_d, nch, key_pos, device, key, launch, forms, s):
        tk = (kind, block_d, nch, key_pos, forms) + tuple(key)
        if s.autotune and s.pinned(kind) is None and tk not in tuned:  # a new class: every candidate built
            tuned.add(tk)
            tuner.precompile(dispatch.distinct(configs.candidates(kind, block_d, nch, forms), kind, key_pos), launch)
        return real_choose(kind, block_d, nch, key_pos, device, key, launch, forms, s)

    def sum_method(part, dtype, run, s):
        if s.dq_sum == "auto":  # timed on a GPU: each method runs once
            for method in dispatch.SUMS:
                run(method)
            return "triton"
        return s.dq_sum

    census.dry = True
    if real_check is not None:
        module.bf16_check = bf16_check
    dispatch.choose, dispatch.sum_method, torch.cuda.synchronize = choose, sum_method, lambda *a, **k: None
    try:
        yield
    finally:
        census.dry = False
        if real_check is not None:
            module.bf16_check = real_check
        dispatch.choose, dispatch.sum_method, torch.cuda.synchronize = real_choose, real_sum, real_sync


def suite_cases() -> list[tuple[str, bool]]:
    sys.path.insert(0, str(REPO / "scripts"))
    import run_gpu_tests

    return run_gpu_tests.collect(["tests", "--gpu-suite"], [])


def report(cases: list[tuple[str, bool]], census: Census) -> dict:
    per_file = Counter(c.split("::")[0] for c, _ in cases)
    per_test = Counter(c.split("[")[0] for c, _ in cases)
    by_kernel = Counter(spec[0].rsplit(".", 1)[1] for spec in census.specs)
    own = Counter(next(iter(tests)) for tests in census.specs.values() if len(tests) == 1)
    asked = Counter(t for tests in census.specs.values() for t in tests)
    building = {c for cs in census.by_case.values() for c in cs}
    own_case = {next(iter(cs)) for cs in census.by_case.values() if len(cs) == 1}
    return {
        "cases": len(cases), "alone": [c for c, a in cases if a], "per_file": dict(per_file),
        "specialisations": len(census.specs), "by_kernel": dict(by_kernel),
        "per_test": {t: {"cases": per_test.get(t) or census.cases[t], "specialisations": asked.get(t, 0),
                         "own": own.get(t, 0)}
                     for t in sorted(set(per_test) | set(census.cases), key=lambda t: -asked.get(t, 0))},
        "cases_building_nothing_of_their_own": sorted(building - own_case),
        "not_counted": census.not_counted,
        "outside_kernel_files": [c for c, _ in cases if c.split("::")[0] not in KERNEL_FILES],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="also write the counts to this file")
    p.add_argument("--no-cases", action="store_true", help="skip the suite's case counts (its own collection)")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the CPU cases run interpreted
    os.environ["KERNELS_AUTOTUNE"] = "0"  # as run_gpu_tests.py sets it
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    cases = [] if args.no_cases else suite_cases()
    census = Census()
    with census.recording():
        code = pytest.main(["-p", "no:cacheprovider", "-n", "0", "-q", "--gpu-suite", *KERNEL_FILES, *extra],
                           plugins=[census])
    out = report(cases, census)
    out["pytest_exit"] = int(code)
    print(json.dumps({k: v for k, v in out.items() if k != "per_test"}, indent=1))
    print("per test: cases, specialisations asked for, of them asked by no other test")
    for t, row in out["per_test"].items():
        print(f"  {row['cases']:4d} {row['specialisations']:4d} {row['own']:4d}  {t}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0 if code in (0, 5) else 1


if __name__ == "__main__":
    raise SystemExit(main())
