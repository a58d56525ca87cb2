"""The batch split of each model size (lrattnres/batch.py): the paper's tokens per update on any GPU count."""

from __future__ import annotations

import copy

import pytest
from conftest import REPO

from lrattnres.batch import PAPER_TOKENS_PER_UPDATE, split, world_size
from lrattnres.config import ConfigError, deep_merge, load_yaml, resolve
from lrattnres.grid import plan, train_spec

RAW = load_yaml(REPO / "config.yaml")


def paper(**over) -> dict:
    return resolve(deep_merge(dict(RAW, scale="paper"), over))


def _refused(**over) -> str:
    with pytest.raises(ConfigError) as e:
        paper(**over)
    return str(e.value)


def test_each_paper_size_has_its_own_split_of_the_papers_update():
    s = paper()
    assert world_size(s) == 8
    got = {p: split(s, p) for p in ("0.5B", "1B", "4B")}
    assert {p: (b["micro_batch"], b["grad_accum"], b["shard_optimizer"]) for p, b in got.items()} == {
        "0.5B": (8, 2, False), "1B": (4, 4, False), "4B": (1, 16, True)}
    assert all(b["tokens_per_update"] == PAPER_TOKENS_PER_UPDATE for b in got.values())
    for run in plan(s):  # every run's spec carries its size's split
        spec = train_spec(s, run)
        b = got[run.preset]
        assert (spec["micro_batch"], spec["grad_accum"]) == (b["micro_batch"], b["grad_accum"])
        assert spec["micro_batch"] * spec["seq_len"] * spec["grad_accum"] * 8 == PAPER_TOKENS_PER_UPDATE
        assert spec.get("shard_optimizer", False) is b["shard_optimizer"]
        assert spec["tokens_per_update"] == PAPER_TOKENS_PER_UPDATE  # the trainer holds the job to it


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (2, 1), (4, 1), (8, 2), (16, 1)])
def test_a_change_of_gpu_count_changes_accumulation_never_tokens(gpus, nodes):
    base = paper()
    s = paper(resources={"train": {"gpu": gpus, "nodes": nodes}})
    for run in plan(s):
        a, b = train_spec(base, run), train_spec(s, run)
        assert b["grad_accum"] * gpus * nodes == a["grad_accum"] * 8
        assert b["steps"] == a["steps"]  # the same updates of the same tokens: the same tokens per run


def test_validation_batches_are_sized_apart_from_training():
    s = paper()
    specs = {r.preset: train_spec(s, r) for r in plan(s)}
    assert {p: sp["val"]["batch_size"] for p, sp in specs.items()} == {"0.5B": 8, "1B": 8, "4B": 8}
    assert specs["4B"]["micro_batch"] == 1  # not copied from training
    s = paper(grid={"pair": {"blocks": 8, "rank": "d/4", "small": {"val_batch_size": 2}}})
    assert next(train_spec(s, r) for r in plan(s) if r.preset == "1B")["val"]["batch_size"] == 2


def test_smaller_scales_keep_their_specs():
    for scale in ("smoke", "tiny", "gpu"):
        s = resolve(dict(RAW, scale=scale))
        for run in plan(s):
            spec = train_spec(s, run)
            assert spec["grad_accum"] == RAW["scales"][scale]["train"]["grad_accum"]
            assert "shard_optimizer" not in spec and "batch_size" not in spec["val"]


def test_the_paper_scale_refuses_another_global_batch():
    msg = _refused(train={"tokens_per_update": 131072})
    assert "train.tokens_per_update" in msg and "262,144" in msg and "131072" in msg


def test_an_explicit_accumulation_that_misses_the_update_is_refused():
    msg = _refused(grid={"pair": {"blocks": 8, "rank": "d/4", "small": {"grad_accum": 3}}})
    assert "grid.pair.small" in msg and "196,608" in msg and "262,144" in msg and "(1B)" in msg
    msg = _refused(train={"grad_accum": 1})
    assert "scales.paper.train:" in msg and "131,072" in msg


def test_auto_accumulation_that_cannot_divide_the_update_is_refused():
    msg = _refused(resources={"train": {"gpu": 3}})
    assert "grad_accum: auto" in msg and "3 GPUs" in msg and "262,144" in msg
    msg = _refused(grid={"pair": {"blocks": 8, "rank": "d/4", "large": {"micro_batch": 3}}})
    assert "grid.pair.large.grad_accum" in msg and "micro_batch 3" in msg


def test_auto_needs_a_tokens_per_update():
    raw = copy.deepcopy(RAW)
    raw["scales"]["tiny"]["train"]["grad_accum"] = "auto"
    with pytest.raises(ConfigError, match=r"train.grad_accum: 'auto' .* train.tokens_per_update, which is not set"):
        resolve(raw)
    raw["scales"]["tiny"]["train"]["tokens_per_update"] = 16 * 128 * 2
    s = resolve(raw)
    assert train_spec(s, plan(s)[0])["grad_accum"] == 2


def test_pair_batch_on_the_main_preset_is_refused():
    raw = copy.deepcopy(RAW)
    raw["scales"]["tiny"]["grid"]["pair"]["small"] = {"micro_batch": 4}  # tiny's small preset is its main one
    with pytest.raises(ConfigError, match=r"grid.pair.small: preset 'tiny' is also the main preset"):
        resolve(raw)
