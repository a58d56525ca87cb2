"""The kernels' settings: one frozen object, passed to every call (``kernels.attnres(...,
settings=...)``); ``DEFAULT`` is read from the environment once, at import.

Environment: KERNELS_AUTOTUNE=0 (run each kind's first candidate, untuned), KERNELS_COMPILE_THREADS
(threads that build a shape class's candidates), KERNELS_CPU_TRITON=1 (CPU tensors through Triton's
interpreter).  Custom ops take a settings object as its ``key`` (a string), which ``Settings.parse``
turns back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping

DQ_SUMS = ("auto", "triton", "once", "torch")
COMPILED_PATHS = ("triton_op", "op")


@dataclasses.dataclass(frozen=True)
class Settings:
    autotune: bool = True  # time every candidate once per shape class (CUDA); off: the first candidate
    compile_threads: int = 8  # threads that build a shape class's candidates before timing (1: in turn)
    cpu_triton: bool = False  # CPU tensors through Triton's interpreter instead of the torch fallback
    fwd: Mapping | None = None  # a pinned forward configuration (launch keywords; SPLIT, KEYCH read by the host)
    bwd: Mapping | None = None  # a pinned backward configuration
    defer: bool = True  # the deferred backward (no residual kept) where a form serves the shape
    defer_max_s: int = 8  # the two-pass form's most sources (past them its re-reads outgrow the L2)
    pair_defer: bool = True  # the resident pair at S <= 2
    pair_fwd: bool = True  # the pair forward's candidates at S = 2
    res_bits: bool = True  # bf16's residual as its bit code (off: the exponent-scaled code, as for fp16)
    lazy_rescale: int = 1  # the forward's lazy online softmax: 0 off, 1 one-token programs, 2 all
    dq_sum: str = "auto"  # the query-gradient partial sum: "triton", "once", "torch", or timed ("auto")
    eager_function: bool = True  # eager calls through an autograd.Function (less host time than the op)
    compiled_path: str = "triton_op"  # compiled calls of S <= 16: "triton_op" (traced by Inductor) or "op"
    fused_reductions: bool | None = None  # multi-operand row reductions; None: on CUDA only
    bwd_programs_per_sm: int = 8  # the persistent backward's grid
    sum_programs_per_sm: int = 4  # the partial sum's first launch
    sum_count_ring: int = 1024  # the one-launch sum's ring of zeroed counters per device and width
    poison: bool = False  # fill fresh outputs with NaN (int8: -128) before the kernels run (tests)
    key: str = dataclasses.field(default="", init=False, compare=False, repr=False)

    def __post_init__(self):
        for name in ("fwd", "bwd"):
            cfg = getattr(self, name)
            if cfg is not None:
                object.__setattr__(self, name, _Frozen(cfg))
        if self.dq_sum not in DQ_SUMS:
            raise ValueError(f"kernels settings: dq_sum must be one of {DQ_SUMS}, got {self.dq_sum!r}")
        if self.compiled_path not in COMPILED_PATHS:
            raise ValueError(f"kernels settings: compiled_path must be one of {COMPILED_PATHS}, "
                             f"got {self.compiled_path!r}")
        if self.lazy_rescale not in (0, 1, 2):
            raise ValueError(f"kernels settings: lazy_rescale must be 0, 1 or 2, got {self.lazy_rescale!r}")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        object.__setattr__(self, "key", json.dumps(fields, sort_keys=True, default=dict))

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    def pinned(self, kind: str) -> dict | None:
        """The pinned configuration of ``kind`` ("fwd" or "bwd"), or None."""
        cfg = getattr(self, kind)
        return None if cfg is None else dict(cfg)

    @staticmethod
    def parse(key: str) -> Settings:
        """The settings whose ``key`` this is ("" for DEFAULT)."""
        return DEFAULT if not key else _parse(key)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        return cls(autotune=env.get("KERNELS_AUTOTUNE", "1") == "1",
                   compile_threads=int(env.get("KERNELS_COMPILE_THREADS", str(min(8, os.cpu_count() or 1)))),
                   cpu_triton=env.get("KERNELS_CPU_TRITON", "0") == "1")


class _Frozen(dict):
    """A pinned configuration: a dict that cannot change and can be hashed."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a pinned configuration of kernels.Settings cannot change: use Settings.replace")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


@functools.lru_cache(maxsize=64)
def _parse(key: str) -> Settings:
    return Settings(**json.loads(key))


DEFAULT = Settings.from_env(os.environ)
