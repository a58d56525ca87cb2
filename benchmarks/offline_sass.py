"""Offline sm_90 builds of this project's four Triton kernels, on a machine without a GPU.

    python benchmarks/offline_sass.py                       # registers, instructions, cp.async copies
    python benchmarks/offline_sass.py --against 63bb3a0     # same machine code as that revision?

Compiles each kernel with triton.compile for a Hopper target (GPUTarget("cuda", 90, 128)) and reads
the cubin with the cuobjdump that Triton's wheel ships: registers, instructions in the whole kernel
and in its innermost loop (the source loop), cp.async copies, the stack and the local-memory loads
and stores (spills), and the seconds the build took (``build_s``, from an empty Triton cache unless
TRITON_CACHE_DIR is set).  With --against, each row also holds that revision's counts ("against").
Why: GPU time costs more than CPU time, and a change meant to leave the measured kernels alone (a
refactor, a new launch option at its default) can be shown to leave their machine code byte for
byte the same; a change meant to alter them (a layout, a pipelined loop) shows its instruction and
register counts before any GPU run.  Run it without TRITON_INTERPRET (the interpreter builds
nothing).

Configurations: --configs NAME[,NAME...] from CONFIGS (default: all), each one launch setting of the
four kernels in bf16 (mostly d = 1536's layouts: three column chunks of 512, the one padded chunk of
2048; and five and two chunks of 512, d = 2560's and d = 1024's layouts).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_COMMON = dict(SLICE=True, HAS_RES=True, RES_STEP=2.0**-15, EVICT=False, LAZY=0)
# name: (column chunk width, chunks, tokens or sources per step, warps, PREFETCH, STAGES[, backward grid[,
# KEY0[, further backward constexprs]]]).  The backward's grid: "persistent" (n = SB sources per step) or "tile" (n = BLOCK_T tokens per
# program); KEY0 the first column chunk holding key columns (kernels.configs.key_pos; 0 = no specialisation).
CONFIGS = {
    "split": (512, 3, 1, 4, 0, 1),
    "split-prefetch": (512, 3, 1, 4, 1, 1),
    "split-stages2": (512, 3, 1, 4, 0, 2),
    "padded": (2048, 1, 1, 4, 1, 1),
    "split-two-per-step": (512, 3, 2, 4, 1, 1),
    "split-tile": (512, 3, 1, 4, 1, 1, "tile"),
    "split-key": (512, 3, 1, 4, 1, 1, "persistent", 2),  # key (r = 384) inside the last chunk: KEY0 = 2
    "split-tile-key": (512, 3, 1, 4, 1, 1, "tile", 2),
    "split-tile-key-stages3": (512, 3, 1, 2, 0, 3, "tile", 2),  # the per-argument backward's default
    "five-tile-key": (512, 5, 1, 4, 1, 1, "tile", 3),  # d = 2560 as 5 x 512, r = 640 (built at d = 1536's signature)
    "two-tile-key": (512, 2, 1, 4, 1, 1, "tile", 1),  # d = 1024 as 2 x 512, r = 256
    "split-tile-key-pair": (512, 3, 1, 4, 1, 1, "tile", 2, {"PAIR": True}),  # two sources per step (untimed)
    "five-tile-key-pair": (512, 5, 1, 4, 1, 1, "tile", 3, {"PAIR": True}),
    # the deferred backward (two passes, g.h from the sources, no h or residual read)
    "split-tile-key-defer": (512, 3, 1, 4, 1, 1, "tile", 2, {"DEFER": True, "HAS_RES": False}),
    "five-tile-key-defer": (512, 5, 1, 4, 1, 1, "tile", 3, {"DEFER": True, "HAS_RES": False}),
    "two-tile-key-defer": (512, 2, 1, 4, 1, 1, "tile", 1, {"DEFER": True, "HAS_RES": False}),
    "split-tile2-key-defer": (512, 3, 2, 4, 1, 1, "tile", 2, {"DEFER": True, "HAS_RES": False}),  # two tokens
    "split-tile4-key-defer": (512, 3, 4, 8, 1, 1, "tile", 2, {"DEFER": True, "HAS_RES": False}),  # four tokens, 8 warps
    "five-tile4-key-defer": (512, 5, 4, 8, 1, 1, "tile", 3, {"DEFER": True, "HAS_RES": False}),
    # the residual's code: RES_STEP 0 is bf16's bit code, 2^-15 (_COMMON) the scaled one
    "split-tile4-key": (512, 3, 4, 4, 1, 1, "tile", 2),  # the forward the tuner takes at d = 1536, S = 9
    "split-tile4-key-bits": (512, 3, 4, 4, 1, 1, "tile", 2, {"RES_STEP": 0.0}),
    "five-tile-key-bits": (512, 5, 1, 4, 1, 1, "tile", 3, {"RES_STEP": 0.0}),
    "split-tile-rd-bits": (512, 3, 1, 4, 1, 1, "tile", 0, {"RES_STEP": 0.0}),  # r = d: no key-free chunk
    # the lazy online softmax: one token (LAZY 1), four tokens (LAZY 2)
    "split-tile-rd-bits-lazy": (512, 3, 1, 4, 1, 1, "tile", 0, {"RES_STEP": 0.0, "LAZY": 1}),
    "split-tile-key-bits-lazy": (512, 3, 1, 4, 1, 1, "tile", 2, {"RES_STEP": 0.0, "LAZY": 1}),
    "split-tile4-key-bits-lazy": (512, 3, 4, 4, 1, 1, "tile", 2, {"RES_STEP": 0.0, "LAZY": 2}),
    "split-tile-key-bits": (512, 3, 1, 4, 1, 1, "tile", 2, {"RES_STEP": 0.0}),
    "split-tile-rd-unmasked": (512, 3, 1, 4, 1, 1, "tile", 0, {"RES_STEP": 0.0, "SLICE": False}),  # r = d as "full"
    "split-tile-rd-unmasked-2w": (512, 3, 1, 2, 1, 1, "tile", 0, {"RES_STEP": 0.0, "SLICE": False}),
    # the deferred token tile looped over by persistent programs (PERSIST, a tuned choice at S = 2)
    "split-tile-key-defer-looped": (512, 3, 1, 2, 1, 1, "tile", 2, {"DEFER": True, "HAS_RES": False, "PERSIST": 16}),
    # the residual token tile looped over by persistent programs, plain and PAIR (tuning candidates)
    "split-tile-key-bits-looped": (512, 3, 1, 2, 1, 1, "tile", 2, {"RES_STEP": 0.0, "PERSIST": 8}),
    "split-tile-key-bits-pair-looped": (512, 3, 1, 2, 1, 1, "tile", 2, {"RES_STEP": 0.0, "PAIR": True, "PERSIST": 6}),
    # the resident pair (DEFER with PAIR, S <= 2), looped, and its block loop pipelined
    "split-tile-key-resident-looped": (512, 3, 1, 4, 0, 1, "tile", 2,
                                       {"DEFER": True, "PAIR": True, "HAS_RES": False, "PERSIST": 8}),
    "split-tile-key-resident-looped-stages2": (512, 3, 1, 4, 0, 2, "tile", 2,
                                               {"DEFER": True, "PAIR": True, "HAS_RES": False, "PERSIST": 8}),
    "split-tile-key-resident-looped-2w-stages2": (512, 3, 1, 2, 0, 2, "tile", 2,
                                                  {"DEFER": True, "PAIR": True, "HAS_RES": False, "PERSIST": 8}),
    "two-tile-key-resident-looped-stages2": (512, 2, 1, 4, 0, 2, "tile", 1,
                                             {"DEFER": True, "PAIR": True, "HAS_RES": False, "PERSIST": 4}),
    "five-tile-key-resident-looped-1w": (512, 5, 1, 1, 0, 1, "tile", 3,
                                         {"DEFER": True, "PAIR": True, "HAS_RES": False, "PERSIST": 32}),
    # the pair forward (FWD_PAIR: the forward's PAIR, S = 2) against the loop forward the
    # tuner took at S = 2 (one token, 1 warp, keyed, prefetch), d = 2560 (r = 640) and d = 1024 (r = 256)
    "five-key-fwd-loop-1w": (512, 5, 1, 1, 1, 1, "tile", 3, {"DEFER": True, "HAS_RES": False}),
    "five-key-fwd-pair-1w": (512, 5, 1, 1, 0, 1, "tile", 3,
                             {"FWD_PAIR": True, "DEFER": True, "PAIR": True, "HAS_RES": False}),
    "five-key-fwd-pair-4w": (512, 5, 1, 4, 0, 1, "tile", 3,
                             {"FWD_PAIR": True, "DEFER": True, "PAIR": True, "HAS_RES": False}),
    "two-key-fwd-pair-1w": (512, 2, 1, 1, 0, 1, "tile", 1,
                            {"FWD_PAIR": True, "DEFER": True, "PAIR": True, "HAS_RES": False}),
    # d = 1024 with r = d as one chunk of 1024: the backward the tuner takes at S = 25 (persistent grid,
    # 4 warps, prefetch) and the token tile beside it
    "one-rd-bits": (1024, 1, 1, 4, 1, 1, "persistent", 0, {"RES_STEP": 0.0}),
    "one-tile-rd-bits": (1024, 1, 1, 4, 1, 1, "tile", 0, {"RES_STEP": 0.0}),
    # the r = d backward as the launchers build it ("slice" at r = d as "full") on the grid the tuner takes:
    # persistent, prefetch; 1 warp at d = 1536 (3 x 512), 2 warps at d = 2560 (5 x 512), 4 warps at d = 1024
    "split-rd-unmasked-1w": (512, 3, 1, 1, 1, 1, "persistent", 0, {"RES_STEP": 0.0, "SLICE": False}),
    "five-rd-unmasked-2w": (512, 5, 1, 2, 1, 1, "persistent", 0, {"RES_STEP": 0.0, "SLICE": False}),
    "one-rd-unmasked": (1024, 1, 1, 4, 1, 1, "persistent", 0, {"RES_STEP": 0.0, "SLICE": False}),
}
_NSLOT = 9


def _table_sig(kind: str) -> dict:
    if kind == "fwd":
        return {"src0_ptr": "*bf16", "src_offs": "*i64", "src_strides": "*i64", "q_ptr": "*bf16", "out_ptr": "*bf16",
                "res_ptr": "*i8", "st_ptr": "*fp32", "N": "i32", "S": "i32", "d": "i32", "r": "i32",
                "inv_n": "fp32", "eps": "fp32"}
    return {"src0_ptr": "*bf16", "src_offs": "*i64", "src_strides": "*i64", "grad0_ptr": "*bf16", "grad_offs": "*i64",
            "q_ptr": "*bf16", "h_ptr": "*bf16", "res_ptr": "*i8", "g_ptr": "*bf16", "st_ptr": "*fp32",
            "dq_part_ptr": "*fp32", "go_ptr": "constexpr", "N": "i32", "S": "i32", "d": "i32", "r": "i32",
            "stride_g": "i32", "inv_n": "fp32", "eps": "fp32"}


def _args_sig(kind: str) -> dict:
    sig = {f"x{i}": "*bf16" if i < _NSLOT else "constexpr" for i in range(16)}
    sig.update({f"xs{i}": "i32" if i < _NSLOT else "constexpr" for i in range(16)})
    if kind == "bwd":
        sig.update({f"dx{i}": "*bf16" if i < _NSLOT else "constexpr" for i in range(16)})
        sig.update({"q_ptr": "*bf16", "h_ptr": "*bf16", "res_ptr": "*i8", "g_ptr": "*bf16", "st_ptr": "*fp32",
                    "dq_part_ptr": "*fp32", "go_ptr": "constexpr", "N": "i32", "S": "i32", "d": "i32", "r": "i32",
                    "stride_g": "i32"})
    else:
        sig.update({"q_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*i8", "st_ptr": "*fp32", "N": "i32", "S": "i32",
                    "d": "i32", "r": "i32"})
    return sig


def _kernels(module, cfg):
    """(name, kernel, signature, constexprs, warps) of the four kernels at one configuration."""
    block, nch, n, warps, prefetch, stages = cfg[:6]
    grid = cfg[6] if len(cfg) > 6 else "persistent"
    c = dict(_COMMON, BLOCK_D=block, NCH=nch, PREFETCH=prefetch, STAGES=stages, KEY0=cfg[7] if len(cfg) > 7 else 0)
    args = dict(NSLOT=_NSLOT, EPS=1e-6)
    bwd = dict(SB=1, BLOCK_T=n) if grid == "tile" else dict(SB=n, BLOCK_T=0)
    bwd["PAIR"] = False  # the two-sources-per-step token tile, off
    bwd["PERSIST"] = 0  # the token tile looped over by persistent programs, off
    bwd["DEFER"] = False  # the two-pass token tile, off; its scratch go_ptr then None
    bwd.update(cfg[8] if len(cfg) > 8 else {})
    fwd = {k: bwd[k] for k in ("HAS_RES", "RES_STEP", "SLICE") if k in bwd}  # a deferred backward's forward keeps none
    fwd["PAIR"] = bwd.pop("FWD_PAIR", False)  # the pair forward (S = 2), off
    if "LAZY" in bwd:  # the forward's lazy online softmax
        fwd["LAZY"] = bwd.pop("LAZY")
    bsig = {"go_ptr": "*fp32"} if (bwd["DEFER"] and not bwd["PAIR"]) else {}  # the two-pass form's g.o scratch
    return [
        ("table-fwd", module._attnres_fwd_kernel, _table_sig("fwd"), dict(c, ALIGN=8, BLOCK_T=n, FUSED=True, **fwd),
         warps),
        ("table-bwd", module._attnres_bwd_kernel, dict(_table_sig("bwd"), **bsig), dict(c, ALIGN=8, GALIGN=8, **bwd),
         warps),
        ("args-fwd", module._attnres_fwd_args_kernel, _args_sig("fwd"), dict(c, **args, BLOCK_T=n, FUSED=True, **fwd),
         warps),
        ("args-bwd", module._attnres_bwd_args_kernel, dict(_args_sig("bwd"), **bsig), dict(c, **args, **bwd), warps),
    ]


def _cuobjdump() -> str:
    import triton

    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    if not found:
        raise SystemExit("offline_sass: this triton wheel ships no cuobjdump")
    return found[0]


def build(fn, sig: dict, const: dict, warps: int) -> dict:
    """Compile for sm_90: registers, the instruction listing without addresses, and op counts.  A
    constexpr the kernel does not take (STAGES in a revision without it) is left out."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    const = {k: v for k, v in const.items() if k in names}
    sig = {k: v for k, v in sig.items() if k in names}  # (an argument a revision's kernel does not take)
    consts = {(names.index(a),): None for a in names if sig.get(a) == "constexpr" and a not in const}
    for k, v in const.items():
        sig[k] = "constexpr"
        consts[(names.index(k),)] = v
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names
             if sig[a] not in ("constexpr", "fp32") and a not in ("N", "S", "r")}
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": warps})
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", x).strip() for x in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", x)]
    return {"registers": int(re.search(r"REG:(\d+)", res).group(1)), "instructions": len(lines),
            "loop_instructions": inner_loop_size(sass), "ldgsts": sum("LDGSTS" in x for x in lines),
            "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
            "spills": sum(bool(re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", x)) for x in lines),
            "build_s": round(build_s, 2), "code": "\n".join(lines)}


def inner_loop_size(sass: str) -> int | None:
    """Instructions in the innermost loop of a cuobjdump listing (the shortest span from a backward
    branch's target to the branch, the trap's branch-to-self left out): the per-step cost that the
    source loop repeats S times, which whole-kernel counts blur."""
    spans = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", sass):
        here, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < here:
            spans.append((here - target) // 16 + 1)
    return min(spans) if spans else None


def _kernel_modules(root: str, name: str):
    """The four kernels of the ``kernels/`` folder under ``root``, imported as package ``name`` without
    running its __init__ (which registers the torch.library ops): from fused_fwd.py and fused_bwd.py,
    or from _triton.py in revisions that keep every kernel in one file."""
    folder = os.path.join(root, "kernels")
    package = types.ModuleType(name)
    package.__path__ = [folder]
    sys.modules[name] = package
    if os.path.exists(os.path.join(folder, "fused_fwd.py")):
        fwd = importlib.import_module(f"{name}.fused_fwd")
        bwd = importlib.import_module(f"{name}.fused_bwd")
        return types.SimpleNamespace(**{k: getattr(m, k) for m, ks in (
            (fwd, ("_attnres_fwd_kernel", "_attnres_fwd_args_kernel")),
            (bwd, ("_attnres_bwd_kernel", "_attnres_bwd_args_kernel"))) for k in ks})
    return importlib.import_module(f"{name}._triton")


def _revision_module(rev: str, tmp: str):
    """The kernels of git revision ``rev`` (its kernels/ folder extracted with git archive)."""
    archive = subprocess.run(["git", "archive", rev, "kernels"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return _kernel_modules(tmp, "kernels_at_rev")


def report(configs, against: str | None = None) -> list[dict]:
    """One row per (configuration, kernel): counts, and whether the code equals ``against``'s."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("offline_sass: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    current = _kernel_modules(ROOT, "kernels_here")
    rows = []
    fresh = "TRITON_CACHE_DIR" not in os.environ
    with tempfile.TemporaryDirectory() as tmp:
        if fresh:  # an empty cache: build_s times real builds
            os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton-cache")
        other = _revision_module(against, tmp) if against else None
        for cname in configs:
            kernels_here = _kernels(current, CONFIGS[cname])
            kernels_there = _kernels(other, CONFIGS[cname]) if other else [None] * 4
            for (kname, fn, sig, const, warps), there in zip(kernels_here, kernels_there):
                here = build(fn, sig, const, warps)
                row = {"config": cname, "kernel": kname, **{k: v for k, v in here.items() if k != "code"}}
                if there is not None:
                    before = build(there[1], sig, const, warps)
                    row["same_code_as_" + against] = before["code"] == here["code"]
                    row["against"] = {k: v for k, v in before.items() if k != "code"}
                rows.append(row)
                print(json.dumps(row), flush=True)
        if fresh:
            del os.environ["TRITON_CACHE_DIR"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    p.add_argument("--against", help="a git revision whose kernels to compare machine code with")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    names = [c for c in a.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"offline_sass: unknown --configs {unknown}; expected names from {sorted(CONFIGS)}")
    rows = report(names, a.against)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"triton": __import__("triton").__version__, "against": a.against, "rows": rows}, f, indent=1)
    key = "same_code_as_" + a.against if a.against else None
    return 0 if key is None or all(r[key] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
