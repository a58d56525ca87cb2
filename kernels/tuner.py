"""The eager autotuner: the fastest of a shape class's candidate launch configurations, in GPU time.

kernels.dispatch asks for a choice once per shape class (dispatch.choose) and passes ``launch(cfg)``,
which runs the whole launch (for the backward: the kernel and the sum of its query-gradient
partials, so that a grid's extra work counts).  Here:

1. Build every candidate before any is launched (:func:`precompile`): compiled in ``threads``
   threads (the settings' compile_threads) under Triton's AsyncCompileMode (the compiler releases the GIL), waited for, then each
   one's module loaded in this thread, one after another.  A candidate that does not build or load
   for lack of resources (registers, shared memory, threads) is left out.
2. Time each built candidate (:func:`fastest`): one warm-up launch, a device synchronisation (so that
   a fault is the candidate's own and not reported at the next launch), then CUDA-graph replays
   (triton.testing.do_bench_cudagraph: GPU time alone, no host dispatch in the number; do_bench's
   timed runs where a launch cannot be captured).

CUDA faults.  A fault in a kernel (misaligned address, illegal address, ...) leaves the process's
CUDA context unusable: every later launch reports the same error, so passing over the candidate is
no help.  The tuner checks the device before it starts (a fault pending from earlier GPU work is
named as such) and after every failure; where the device is broken it stops with
:class:`TuningFault`, naming the candidate, the shape class and the error.  A failure on a healthy
device (a resource error at compile, load or launch) passes over the candidate.  See docs/kernel.md,
"Known limits", for the side-by-side failure this guards against.
"""

from __future__ import annotations

import torch

TUNE_WARMUP_MS = 10  # triton.testing.do_bench per candidate, the fallback where capture fails
TUNE_REP_MS = 40  # milliseconds of replays (or of runs) per candidate


class TuningFault(RuntimeError):
    """A CUDA error that broke the device's context during tuning (not a candidate to pass over)."""


def cuda_fault(device) -> str | None:
    """The CUDA error pending on ``device`` (a synchronisation reports a fault of any earlier kernel),
    or None where the device is healthy or not a CUDA device."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any error here means the context is broken
        return f"{type(e).__name__}: {e}"
    return None


def _fault(device, what: str, cfg, err: BaseException | None, tag: str) -> None:
    """Raise TuningFault if ``device`` has a pending CUDA error."""
    fault = cuda_fault(device)
    if fault is None:
        return
    raise TuningFault(
        f"attnres tuning ({tag}): the CUDA device failed {what}"
        + (f" (candidate {cfg})" if cfg is not None else "")
        + f": {fault}.  A CUDA fault is sticky: no later launch in this process can run, so the tuner "
        "stops here.  " + ("The error was pending before tuning started: it comes from earlier GPU work, "
                           "not from a candidate.  " if cfg is None else "")
        + "KERNELS_AUTOTUNE=0 runs the first candidate without tuning; KERNELS_COMPILE_THREADS=1 "
        "builds the candidates one after another (docs/kernel.md, Known limits)."
    ) from err


def _result(kernel):
    """The compiled kernel behind an AsyncCompileMode placeholder (waits for its compile)."""
    result = getattr(kernel, "result", None)
    return result() if callable(result) else kernel


def _load(kernel) -> None:
    """Load a compiled kernel's module in this thread (Triton otherwise loads it at the first launch)."""
    for k in kernel if isinstance(kernel, (list, tuple)) else (kernel,):
        if k is None:
            continue
        init = getattr(_result(k), "_init_handles", None)
        if callable(init):
            init()


def _compile_all(cands: list, launch, threads: int) -> None:
    """Compile every candidate with ``launch(cfg, warm=True)`` in ``threads`` threads (Triton's
    AsyncCompileMode; nothing is loaded or launched there) and wait for all of them.  A build that
    fails here is built again, and fails with its own error, in :func:`precompile`."""
    if threads <= 1 or len(cands) < 2:
        return
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    try:
        with ThreadPoolExecutor(min(threads, len(cands))) as pool:
            try:
                mode = AsyncCompileMode(pool, ignore_errors=True)
            except TypeError:  # a Triton whose AsyncCompileMode has no ignore_errors
                mode = AsyncCompileMode(pool)
            with mode:
                for cfg in cands:
                    try:
                        launch(cfg, warm=True)
                    except Exception:  # noqa: BLE001 - built again, failing with its own error, below
                        pass
            # leaving the mode waited for every compile; leaving the pool joins its threads
    except Exception:  # noqa: BLE001 - each candidate is built again, one after another, below
        return


def precompile(cands: list, launch, device=None, tag: str = "", threads: int = 1) -> tuple[list, dict]:
    """Build every candidate before any is launched: compiled (in threads, :func:`_compile_all`),
    then, in this thread and one after another, built again from Triton's cache and its module
    loaded.  Returns (the candidates that built, {index of a candidate left out: its error}).  A
    failure with the device broken raises TuningFault."""
    _compile_all(cands, launch, threads)
    built, failed = [], {}
    for i, cfg in enumerate(cands):
        try:
            _load(launch(cfg, warm=True))
        except Exception as e:  # noqa: BLE001 - a configuration the device cannot build or load
            _fault(device, "while building a candidate", cfg, e, tag)
            failed[i] = e
            continue
        built.append(cfg)
    return built, failed


def gpu_time(fn) -> float:
    """Median GPU milliseconds of ``fn()``: CUDA-graph replays (triton.testing.do_bench_cudagraph; no
    host-side dispatch in the number), or do_bench's timed runs where ``fn`` cannot be captured."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=TUNE_REP_MS, return_mode="median")
    except Exception:  # noqa: BLE001 - a launch that cannot be captured is timed by the host
        torch.cuda.synchronize()
        return do_bench(fn, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")


def fastest(cands: list, launch, device=None, tag: str = "", threads: int = 1):
    """The candidate with the least GPU time of ``launch(cfg)`` (:func:`gpu_time`), every candidate
    built first (:func:`precompile`).  A candidate that does not build, load or launch on a healthy
    device is passed over; a broken device raises TuningFault; if no candidate runs, RuntimeError
    lists why each failed.  ``tag`` names the shape class in messages."""
    _fault(device, "before tuning started", None, None, tag)
    built, failed = precompile(cands, launch, device, tag, threads)
    failed = {str(cands[i]): e for i, e in failed.items()}
    best, best_t = None, float("inf")
    for cfg in built:
        try:
            launch(cfg)  # warm-up, outside the timing
            _fault(device, "in a candidate's first launch", cfg, None, tag)
            t = gpu_time(lambda: launch(cfg))
        except TuningFault:
            raise
        except Exception as e:  # noqa: BLE001 - a configuration the device cannot run
            _fault(device, "while timing a candidate", cfg, e, tag)
            failed[str(cfg)] = e
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        why = "; ".join(f"{c}: {type(e).__name__}: {str(e)[:200]}" for c, e in failed.items())
        last = next(reversed(failed.values()), None)
        raise RuntimeError(f"attnres: no launch configuration ran ({len(cands)} tried{', ' + tag if tag else ''}): "
                           f"{why}") from last
    return best
