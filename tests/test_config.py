"""config.yaml, its schema and the scale resolution: bad input stops with the key named."""

from __future__ import annotations

import copy

import pytest

from lrattnres.config import ConfigError, deep_merge, load_yaml, resolve

from conftest import REPO

RAW = load_yaml(REPO / "config.yaml")


@pytest.mark.parametrize("scale", ["smoke", "tiny", "gpu", "paper"])
def test_every_scale_resolves(scale):
    s = resolve(dict(RAW, scale=scale))
    assert s["scale"] == scale
    assert s["results"] == f"results/{scale}"
    assert s["recipe"]["optim"]["muon"]["momentum"] == 0.95  # the shared recipe under any scale override
    assert s["recipe"]["z_loss"] == 1e-5
    if scale == "paper":
        assert s["recipe"]["optim"]["muon"]["lr"] == 0.001 and s["recipe"]["optim"]["adam"]["lr"] == 0.0003


def test_only_the_paper_scale_trains_the_papers_own_runs():
    runs = {scale: resolve(dict(RAW, scale=scale))["paper_runs"] for scale in RAW["scales"]}
    assert runs == {scale: scale == "paper" for scale in RAW["scales"]}


def test_default_scale_is_tiny():
    assert resolve(RAW)["scale"] == "tiny"


def test_scale_recipe_refines_the_shared_recipe():
    s = resolve(RAW)
    assert s["recipe"]["optim"]["muon"] == {"lr": 0.08, "momentum": 0.95, "weight_decay": 0.1}
    assert s["recipe"]["optim"]["adam"]["betas"] == [0.9, 0.95]


def test_top_level_section_overrides_scale_key_by_key():
    s = resolve(dict(RAW, train={"steps": 7}))
    assert s["train"]["steps"] == 7
    assert s["train"]["seq_len"] == RAW["scales"]["tiny"]["train"]["seq_len"]


def test_nested_override_like_snakemake_config_merge():
    raw = deep_merge(RAW, {"scales": {"tiny": {"train": {"micro_batch": 3}}}})
    assert resolve(raw)["train"]["micro_batch"] == 3


def _bad(mutate):
    raw = copy.deepcopy(RAW)
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        resolve(raw)
    return str(e.value)


def test_unknown_scale_names_key_and_choices():
    msg = _bad(lambda r: r.update(scale="huge"))
    assert "scale" in msg and "'huge'" in msg and "smoke, tiny, gpu, paper" in msg


def test_typo_in_key_is_an_error():
    msg = _bad(lambda r: r["scales"]["tiny"]["train"].update(stepz=3))
    assert "scales.tiny.train" in msg and "'stepz'" in msg and "steps" in msg


def test_typo_at_top_level():
    msg = _bad(lambda r: r.update(scael="tiny"))
    assert "'scael'" in msg


def test_recorded_results_are_not_part_of_the_config():
    """Where results measured elsewhere are recorded lives in reports/recorded.yaml, which the report
    rule reads: the config refuses the key and names the file."""
    assert "recorded" not in RAW and "recorded" not in resolve(RAW)
    msg = _bad(lambda r: r.update(recorded={"kernel": "k.json"}))
    assert "recorded" in msg and "reports/recorded.yaml" in msg


def test_negative_rank():
    msg = _bad(lambda r: r["scales"]["tiny"]["grid"].update(ranks=[-4]))
    assert "scales.tiny.grid.ranks.0" in msg


def test_rank_wider_than_model():
    msg = _bad(lambda r: r["scales"]["tiny"]["grid"].update(ranks=[4096]))
    assert "grid.ranks[0]" in msg and "d=64" in msg


def test_blocks_more_than_writes():
    msg = _bad(lambda r: r["scales"]["tiny"]["grid"].update(blocks=[64]))
    assert "grid.blocks[0]" in msg and "2L=8" in msg


def test_unknown_preset():
    msg = _bad(lambda r: r["scales"]["tiny"]["presets"].update(main="tiny-xl"))
    assert "presets.main" in msg and "tiny-xl" in msg


def test_wrong_type():
    msg = _bad(lambda r: r["scales"]["tiny"]["train"].update(steps="many"))
    assert "scales.tiny.train.steps" in msg


# ---- overrides as Snakemake passes them ----------------------------------------------------------


def test_text_values_of_nested_config_are_read_as_the_schema_types():
    """`--config 'train={"steps": 50}'`: Snakemake hands every nested value over as text."""
    s = resolve(dict(RAW, scale="smoke", train={"steps": "50", "compile": "true", "schedule": {"warmdown_frac": "0.3"}},
                     grid={"ranks": ["d/4", "8"]}, data={"embedded": {"max_documents": "null"}},
                     evaluate={"limit": "5"}))
    assert s["train"]["steps"] == 50 and s["train"]["compile"] is True
    assert s["train"]["schedule"]["warmdown_frac"] == 0.3
    assert s["grid"]["ranks"] == ["d/4", 8]
    assert s["data"]["embedded"]["max_documents"] is None
    assert s["evaluate"]["limit"] == 5  # a stage's own settings: numbers read as numbers
    assert resolve(dict(RAW, scale="smoke", results=2024))["results"] == "2024/smoke"


@pytest.mark.parametrize("section, value, key", [
    ("train", {"steps": "fifty"}, "train.steps"),
    ("train", {"compile": "maybe"}, "train.compile"),
    ("recipe", {"optim": {"adam": {"betas": ["0.9", "x"]}}}, "recipe.optim.adam.betas.1"),
])
def test_text_that_reads_as_nothing_valid_is_refused_by_key(section, value, key):
    msg = _bad(lambda r: r.update({"scale": "smoke", section: value}))
    assert f"{key}:" in msg and "cannot be read as" in msg


def test_top_level_recipe_overrides_the_scale_recipe_key_by_key():
    """A --configfile's top-level recipe wins over the scale's own recipe block, key by key."""
    raw = deep_merge(RAW, {"recipe": {"optim": {"muon": {"lr": 0.005}}, "z_loss": 0.0}})
    s = resolve(raw)  # tiny: its own recipe sets muon.lr 0.08
    assert s["recipe"]["optim"]["muon"] == {"lr": 0.005, "momentum": 0.95, "weight_decay": 0.1}
    assert s["recipe"]["optim"]["adam"]["lr"] == RAW["scales"]["tiny"]["recipe"]["optim"]["adam"]["lr"]
    assert s["recipe"]["z_loss"] == 0.0
    from lrattnres.grid import plan, train_spec

    spec = train_spec(s, plan(s)[0])
    assert spec["optim"]["muon"]["lr"] == 0.005 and spec["z_loss"] == 0.0


def test_science_leaves_out_execution_settings():
    from lrattnres.config import science

    a = resolve(RAW)
    b = resolve(deep_merge(RAW, {"resources": {"default": {"mem_mb": 123}}, "data": {"num_threads": 7},
                                 "results": "elsewhere",
                                 "train": {"log_every_s": 5, "grad_guard": {"factor": 20, "window": 50}}}))
    assert a != b and science(a) == science(b)
    assert "resources" not in science(a) and "num_threads" not in science(a)["data"]
    assert not {"log_every_s", "grad_guard"} & set(science(b)["train"])
    c = resolve(deep_merge(RAW, {"train": {"steps": 7}}))
    assert science(c) != science(a)


def test_timing_rules_never_share_a_gpu():
    msg = _bad(lambda r: r.update(scale="gpu", resources={"throughput": {"jobs_per_gpu": 2}}))
    assert "resources.throughput.jobs_per_gpu" in msg and "expected 1" in msg


def _hide_flash_attn(monkeypatch, installed: bool):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "flash_attn" else real(name, *a))


@pytest.mark.parametrize("where", ["recipe", "scale recipe", "base recipe", "throughput"])
def test_flash_attention_without_the_package_is_refused_naming_the_key(monkeypatch, where):
    _hide_flash_attn(monkeypatch, installed=False)
    raw = copy.deepcopy(RAW)
    if where == "recipe":
        raw["recipe"], key = {"attention": "flash"}, "recipe.attention"
    elif where == "scale recipe":
        raw["scales"]["gpu"]["recipe"] = {"attention": "flash"}
        key = "scales.gpu.recipe.attention"
    elif where == "base recipe":
        raw["base"]["recipe"]["attention"], key = "flash", "base.recipe.attention"
    else:
        raw["throughput"], key = {"attention": "flash"}, "throughput.attention"
    with pytest.raises(ConfigError, match=rf"config.yaml: {key}: 'flash' needs the flash-attn package.*\[flash\]"):
        resolve(dict(raw, scale="gpu"))
    # with flash-attn installed the same config resolves, and the other backends never need it
    _hide_flash_attn(monkeypatch, installed=True)
    assert resolve(dict(raw, scale="gpu"))
    _hide_flash_attn(monkeypatch, installed=False)
    for backend in ("auto", "flex", "sdpa"):
        assert resolve(dict(RAW, scale="gpu", recipe={"attention": backend},
                            throughput={"attention": backend}))
