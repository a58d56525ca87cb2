"""The stages' own defaults and the config schema say the same thing.

A stage runs by hand with its own defaults (``lrattnres.data.spec.DEFAULTS``, the training recipe in
``lrattnres.train.spec.DEFAULTS`` and ``lrattnres.model.ModelConfig``); the workflow passes it the
settings of config.yaml, whose keys workflow/schemas/config.schema.yaml lists. These tests hold the
two together: every key the schema lets a config set is a key the stage reads, every value the stage
takes by default is one the schema allows, and config.yaml's base recipe is the stage's recipe.
"""

from __future__ import annotations

import dataclasses

import jsonschema
import pytest
import yaml
from conftest import REPO

from lrattnres.config import SCHEMA_PATH
from lrattnres.data.spec import DEFAULTS as DATA_DEFAULTS
from lrattnres.gridplan import TRAIN_CLI_KEYS
from lrattnres.model import ModelConfig
from lrattnres.train import spec as train_spec

SCHEMA = yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))
# Keys of the recipe that the workflow moves into the run's model config (lrattnres/gridplan.py).
MODEL_KEYS = ("router", "attention", "norm_eps", "stream_dtype")


def _resolve(node: dict) -> dict:
    while "$ref" in node:
        target = SCHEMA
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _schema_leaves(node: dict, prefix: str = "") -> dict[str, dict]:
    """Dotted key -> subschema for every key of an object schema, down to the first key that is not
    an object with listed properties."""
    node = _resolve(node)
    out = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        if "properties" in _resolve(sub):
            out.update(_schema_leaves(sub, path + "."))
        else:
            out[path] = sub
    return out


def _value_leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_value_leaves(v, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = v
    return out


def _allows(sub: dict, value) -> bool:
    return jsonschema.Draft202012Validator({**_resolve(sub), "$defs": SCHEMA["$defs"]}).is_valid(value)


def test_the_data_section_lists_exactly_the_data_stages_keys():
    schema = _schema_leaves(SCHEMA["$defs"]["data"])
    defaults = _value_leaves(DATA_DEFAULTS)
    assert set(schema) == set(defaults)


@pytest.mark.parametrize("key", sorted(_value_leaves(DATA_DEFAULTS)))
def test_the_data_stages_defaults_are_values_the_schema_allows(key):
    """A config may state any default (null stands for "not set" where the schema wants a value)."""
    value = _value_leaves(DATA_DEFAULTS)[key]
    if value is not None:
        assert _allows(_schema_leaves(SCHEMA["$defs"]["data"])[key], value), (key, value)


def _train_keys() -> set[str]:
    """Every dotted key the training spec reads: its defaults, the keys a scale must give, the optional ones."""
    given = {"steps", "tokens", "micro_batch", "seq_len", *train_spec.OPTIONAL_FLAGS, *train_spec.OPTIONAL_INTS,
             *TRAIN_CLI_KEYS}
    return set(_value_leaves(train_spec.DEFAULTS)) | given


def test_every_recipe_and_train_key_of_the_schema_is_read_by_the_trainer():
    schema = {**_schema_leaves(SCHEMA["$defs"]["recipe"]), **_schema_leaves(SCHEMA["$defs"]["train"])}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unread = sorted(k for k in schema if k not in _train_keys() and not (k in MODEL_KEYS and k in model_fields))
    assert unread == []


def test_the_trainers_defaults_are_values_the_schema_allows():
    schema = {**_schema_leaves(SCHEMA["$defs"]["recipe"]), **_schema_leaves(SCHEMA["$defs"]["train"])}
    model_defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    defaults = {**_value_leaves(train_spec.DEFAULTS), **{k: model_defaults[k] for k in MODEL_KEYS}}
    checked = 0
    for key, sub in schema.items():
        if key in defaults and defaults[key] is not None:
            assert _allows(sub, defaults[key]), (key, defaults[key])
            checked += 1
    assert checked >= 15


def test_the_base_recipe_of_config_yaml_is_the_trainers_recipe():
    """config.yaml states the paper's recipe (Section 4.1) that the trainer takes by default: a run
    started by hand with a bare spec trains as the workflow's runs do."""
    base = yaml.safe_load((REPO / "config.yaml").read_text(encoding="utf-8"))["base"]["recipe"]
    model_defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    stage = {**_value_leaves(train_spec.DEFAULTS), **{k: model_defaults[k] for k in MODEL_KEYS}}
    stated = _value_leaves(base)
    assert set(stated) <= set(stage)
    assert {k: stage[k] for k in stated} == stated
