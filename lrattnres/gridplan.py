"""The experiment grid's plan: which training runs a scale makes, and what the later stages take of them.

:func:`plan` turns a scale's ``grid`` settings into the list of runs of Sections 4.2-4.5 and Appendix
C: the rank/grouping sweep and the baseline on the main preset, extra seeds of the headline pair, the
full-width-RMS control, the projected-key configurations and the size pair.  At the paper scale that
is exactly the paper's run list (48 runs).  A scale with a learning-rate check (``grid.lr_check``,
:mod:`lrattnres.lrcheck`) also plans the check's baseline runs, last: one per multiplier of the
check's reference rates, named ``<preset>-baseline-lrx<multiplier>-s0``; they stand for no row of
the paper.  Runs are deduplicated by id, so a grid point that serves
two roles trains once.  :func:`train_spec` is the training spec of one run, :func:`paper_row` the
paper's row a run stands for, :func:`conversions` and :func:`evaluations` the runs that the conversion
and the downstream evaluation take.

The plan reads only the settings: the workflow names its jobs with it and the per-run diagnostics
find their run in it.  What the runs' results say is :mod:`lrattnres.grid` (which re-exports these
names).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lrattnres import batch, memory
from lrattnres.merge import deep_merge
from lrattnres.presets import get_preset
from lrattnres.ranks import resolve_rank

# The paper's sweep axes: a small-scale run maps to a paper row when its N is one of these and its
# r/d ratio lands on one of the paper's ranks at d = 1024.
PAPER_D = 1024
PAPER_RANKS = (16, 32, 64, 128, 256, 512, 768, 1024)
PAPER_BLOCKS = ("full", 4, 8, 16)
PAIR_SIZES = ("1b", "4b")
# The roles of Section 4.4 map onto the paper's rows whatever their N and r at a small scale.
HEADLINE_LR, HEADLINE_ATTNRES, CONTROL = "lr.n8.r128", "attnres.n8.r1024", "lr-fullrms.n8.r128"
# The role of the learning-rate check's runs (baselines at multiples of the check's reference rates).
LR_CHECK = "lr-check"


@dataclass(frozen=True)
class Run:
    """One training run of the grid."""

    preset: str
    method: str  # baseline | attnres | lr | lr-fullrms | plr
    blocks: int | str | None  # None for the baseline
    rank: int | None  # None for the baseline
    seed: int
    steps: int | None = None  # overrides the scale's training length (the size pair)
    roles: tuple[str, ...] = field(default=(), compare=False)
    lr_scale: float | None = None  # the learning-rate check: its multiple of the check's reference rates

    @property
    def run_id(self) -> str:
        if self.lr_scale is not None:
            return f"{self.preset}-{self.method}-lrx{multiplier_text(self.lr_scale)}-s{self.seed}"
        if self.method == "baseline":
            return f"{self.preset}-baseline-s{self.seed}"
        return f"{self.preset}-{self.method}-n{self.blocks}-r{self.rank}-s{self.seed}"

    def model(self) -> dict[str, Any]:
        m: dict[str, Any] = {"preset": self.preset, "method": self.method}
        if self.method != "baseline":
            m.update(blocks=self.blocks, rank=self.rank)
        return m


def multiplier_text(m: float) -> str:
    """A multiplier as it appears in a run id: 2 -> "2", 0.5 -> "0.5"."""
    return f"{int(m)}" if float(m).is_integer() else f"{m:g}"


def lr_check_runs(settings: dict) -> list[Run]:
    """The learning-rate check's runs: the main preset's baseline, seed 0, once per multiplier."""
    check = settings["grid"].get("lr_check")
    if not check:
        return []
    main = settings["presets"]["main"]
    return [Run(main, "baseline", None, None, 0, roles=(LR_CHECK,), lr_scale=float(m)) for m in check["multipliers"]]


def _routed(preset: str, blocks, rank, seed: int, *, method: str | None = None, steps=None, role: str) -> Run:
    d = get_preset(preset)["d_model"]
    r = resolve_rank(rank, d, where=f"grid ({role})")
    method = method or ("attnres" if r == d else "lr")
    return Run(preset, method, blocks, r, seed, steps, (role,))


def plan(settings: dict) -> list[Run]:
    """Every training run of the scale, deduplicated, in a stable order."""
    grid, presets = settings["grid"], settings["presets"]
    main = presets["main"]
    d_main = get_preset(main)["d_model"]
    runs: list[Run] = [Run(main, "baseline", None, None, 0, roles=("baseline",))]
    for blocks in grid["blocks"]:
        for rank in grid["ranks"]:
            runs.append(_routed(main, blocks, rank, 0, role="sweep"))
    if "headline" in grid:
        h = grid["headline"]
        for seed in range(grid.get("seeds", 1)):
            runs.append(_routed(main, h["blocks"], h["rank"], seed, method="lr", role="seeds"))
            runs.append(_routed(main, h["blocks"], d_main, seed, method="attnres", role="seeds"))
    if "control" in grid:
        c = grid["control"]
        runs.append(_routed(main, c["blocks"], c["rank"], 0, method="lr-fullrms", role="control"))
    for p in grid.get("projected", []):
        runs.append(_routed(main, p["blocks"], p["rank"], 0, method="plr", role="projected"))
    if "pair" in grid:
        pair = grid["pair"]
        for size_role in ("small", "large"):
            preset = presets[size_role]
            d = get_preset(preset)["d_model"]
            steps = pair.get("steps")
            runs.append(_routed(preset, pair["blocks"], d, 0, method="attnres", steps=steps, role=f"pair-{size_role}"))
            runs.append(_routed(preset, pair["blocks"], pair["rank"], 0, method="lr", steps=steps, role=f"pair-{size_role}"))
    runs += lr_check_runs(settings)
    merged: dict[str, Run] = {}
    for run in runs:
        if run.run_id in merged:
            old = merged[run.run_id]
            merged[run.run_id] = Run(**{**asdict(old), "roles": tuple(dict.fromkeys(old.roles + run.roles))})
        else:
            merged[run.run_id] = run
    return list(merged.values())


# Keys of a scale's ``train`` settings that the train rule gives the trainer as command-line options,
# not in its spec: execution settings. ``on_code_change``: what a checkpoint written by other training
# code does (``python -m lrattnres train --on-code-change``).
TRAIN_CLI_KEYS = ("on_code_change",)


def train_spec(settings: dict, run: Run) -> dict:
    """The training spec of one run: the recipe, the scale's training settings with the batch split
    of the run's size (lrattnres/batch.py), the run's model.

    A run of the learning-rate check takes Muon's and Adam's rates as its multiple of the check's
    reference rates (everything else of the recipe as the scale's: schedule, warm-up, z-loss,
    clipping), so that its spec does not depend on the rates the scale chose; and it records a
    non-finite loss as its result instead of failing (``record_nonfinite``): a diverged multiplier is
    an outcome of the check."""
    recipe = copy.deepcopy(settings["recipe"])
    if run.lr_scale is not None:
        ref = settings["grid"]["lr_check"]["reference"]
        optim = recipe.setdefault("optim", {})
        for group in ("muon", "adam"):
            optim[group] = {**optim.get(group, {}), "lr": ref[group] * run.lr_scale}
    model = run.model()
    for key in ("router", "attention", "norm_eps", "stream_dtype"):
        if key in recipe:
            model[key] = recipe.pop(key)
    spec = deep_merge(recipe, settings["train"])
    for key in TRAIN_CLI_KEYS:  # given to the trainer on its command line
        spec.pop(key, None)
    b = batch.split(settings, run.preset)  # the size's micro-batch, accumulation (auto resolved) ...
    spec["micro_batch"], spec["grad_accum"] = b["micro_batch"], b["grad_accum"]
    for key in ("shard_optimizer", "activation_checkpointing"):
        spec.pop(key, None)
    if b["shard_optimizer"]:
        spec["shard_optimizer"] = True
    if memory.checkpointing(settings, run.preset):  # auto: where the size would not fit without it
        spec["activation_checkpointing"] = True
    if b["val_batch_size"] is not None:
        spec["val"] = {**spec.get("val", {}), "batch_size": b["val_batch_size"]}
    spec["model"] = model
    spec["seed"] = run.seed
    if run.steps is not None:
        spec.pop("tokens", None)
        spec["steps"] = run.steps
    if run.lr_scale is not None:
        spec["record_nonfinite"] = True
    return spec


def paper_row(run: dict, d_model: int) -> str | None:
    """The paper's row key (``lr.n8.r128``) this run stands for, or None if it has no analogue (a run
    of the learning-rate check stands for none)."""
    if list(run.get("roles") or ()) == [LR_CHECK]:
        return None
    if run["method"] == "baseline":
        return "baseline"
    blocks = run["blocks"]
    if blocks not in PAPER_BLOCKS:
        return None
    ratio = run["rank"] / d_model
    paper_r = round(ratio * PAPER_D)
    if paper_r not in PAPER_RANKS or not math.isclose(paper_r / PAPER_D, ratio, rel_tol=1e-9):
        return None
    return f"{run['method']}.n{blocks}.r{paper_r}"


# ------------------------------------------------------------------------- runs of the later stages

SIZE_OF_ROLE = {"sweep": "0.5b", "pair-small": "1b", "pair-large": "4b"}


def _claim_size(run: Run, order=("pair-large", "pair-small", "sweep")) -> str | None:
    """Which of the paper's model sizes a run stands for (its first role, in ``order``, that has one)."""
    for role in order:
        if role in run.roles:
            return SIZE_OF_ROLE[role]
    return None


def conversions(settings: dict) -> list[dict]:
    """Section 4.8: every standard AttnRes run of seed 0 is converted to the scale's conversion rank.

    ``settings["convert"]["rank"]`` maps a preset name to its rank (an int, ``"d/<k>"`` or ``"k"``
    for the checkpoint's joint query rank)."""
    ranks = settings.get("convert", {}).get("rank", {})
    out = []
    for run in plan(settings):
        if run.method != "attnres" or run.seed != 0:
            continue
        size = _claim_size(run, order=("sweep", "pair-small", "pair-large"))
        out.append({
            "run_id": run.run_id,
            "rank": ranks.get(run.preset, "k"),
            "claim_row": f"{size}.n{run.blocks}" if size else None,
        })
    return out


def evaluations(settings: dict) -> list[dict]:
    """Appendix G: the size pair's runs are evaluated downstream, standing for 1B and 4B."""
    out = []
    for run in plan(settings):
        for role in ("pair-small", "pair-large"):
            if role in run.roles:
                out.append({"run_id": run.run_id, "claim_size": SIZE_OF_ROLE[role]})
                break
    return out
