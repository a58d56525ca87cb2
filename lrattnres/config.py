"""Load, validate and resolve config.yaml into the settings of one scale.

Values given as text where the schema wants a number, a boolean or null (Snakemake passes every
value nested in ``--config 'train={"steps": 50}'`` as a string) are converted first; a value that
cannot be converted is refused with its key.  The raw config is then validated against
``workflow/schemas/config.schema.yaml`` (so a typo in a key is an error, not a silently ignored
setting).  The settings of the selected scale are ``base`` (what every scale starts from), refined
by the scale's block, overridden key by key by the top-level sections (a ``--configfile`` or
``--config``).  Semantic checks that need the model presets run last (a rank wider than the model,
more blocks than writes), and those that need the installed packages (attention ``flash`` needs
flash-attn, the optional ``flash`` extra; the check runs in the Python that checks the config, e.g.
Snakemake's).  Every error names the file, the key and what was expected.

``python -m lrattnres config [--config config.yaml] [--scale tiny]`` prints the resolved settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import yaml

from lrattnres import batch, jobplan, memory, presets
from lrattnres.errors import UserError
from lrattnres.merge import deep_merge
from lrattnres.ranks import resolve_rank

REPO = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO / "workflow" / "schemas" / "config.schema.yaml"
# Sections of a scale block that may also be given at the top level to override the scale's.
SECTIONS = (
    "presets",
    "recipe",
    "data",
    "train",
    "grid",
    "accounting",
    "resources",
    "convert",
    "evaluate",
    "throughput",
    "diagnostics",
    "kernel_check",
    "pieces",
    "cluster",
)


class ConfigError(UserError, ValueError):
    """A config that cannot be run; the message names the file, the key and the expectation."""


def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _key_path(parts) -> str:
    return ".".join(str(p) for p in parts) or "<top level>"


def _resolve_ref(schema, root: dict):
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/"):
        node = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _types(schema, root: dict) -> set[str]:
    """The JSON types a (sub)schema names, through $ref, oneOf/anyOf, enum and const."""
    schema = _resolve_ref(schema, root)
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = {t} if isinstance(t, str) else set(t or ())
    for key in ("oneOf", "anyOf"):
        for branch in schema.get(key, []):
            out |= _types(branch, root)
    for v in [*schema.get("enum", []), *([schema["const"]] if "const" in schema else [])]:
        out.add({type(None): "null", bool: "boolean", int: "integer", float: "number"}.get(type(v), "string"))
    return out


def _readings(text: str) -> list:
    """What a text could stand for, most specific first: integer, finite number, boolean, null,
    a YAML list or mapping."""
    out: list = []
    t = text.strip()
    try:
        out.append(int(t))
    except ValueError:
        pass
    try:
        f = float(t)
        if math.isfinite(f):
            out.append(f)
    except ValueError:
        pass
    if t.lower() in ("true", "false"):
        out.append(t.lower() == "true")
    if t.lower() in ("null", "~"):
        out.append(None)
    if t[:1] in "[{":
        try:
            out.append(yaml.safe_load(t))
        except yaml.YAMLError:
            pass
    return out


def _fits(value, schema, root: dict) -> bool:
    import jsonschema

    schema = _resolve_ref(schema, root)
    if not isinstance(schema, dict):
        return True
    doc = {**schema, "$defs": root.get("$defs", {})}
    return jsonschema.validators.validator_for(root)(doc).is_valid(value)


def _subschema(schema, key, root: dict):
    """The schema of ``key`` (a name, or an index) inside ``schema``; ``{}`` (anything) inside an
    object or array the schema leaves open; None for a key the schema does not know."""
    schema = _resolve_ref(schema, root)
    if not isinstance(schema, dict):
        return {}
    if isinstance(key, int):
        return schema.get("items", {})
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    for branch in schema.get("oneOf", []) + schema.get("anyOf", []):
        sub = _subschema(branch, key, root)
        if sub is not None and sub != {}:
            return sub
    extra = schema.get("additionalProperties", {})
    return extra if isinstance(extra, dict) else None


def coerce(value, schema, root: dict, where: tuple = (), source: str = "config.yaml"):
    """``value`` with every text turned into the number, boolean, null, list or mapping its schema
    wants (Snakemake passes nested ``--config`` values as text), and a number into text where only
    text is allowed. Text that the schema does not admit and that reads as nothing it admits is
    refused, naming the key. Where the schema leaves a value open (a stage's own settings), a text
    that reads as a number, a boolean or null becomes one."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            sub = _subschema(schema, k, root)
            out[k] = v if sub is None else coerce(v, sub, root, (*where, k), source)
        return out
    if isinstance(value, list):
        return [coerce(v, _subschema(schema, i, root), root, (*where, i), source) for i, v in enumerate(value)]
    types = _types(schema, root)
    if isinstance(value, str):
        if not types:  # open: read it as YAML would
            return next(iter(_readings(value)), value)
        if "string" in types and _fits(value, schema, root):
            return value
        for reading in _readings(value):
            if _fits(reading, schema, root):
                return coerce(reading, schema, root, where, source) if isinstance(reading, (dict, list)) else reading
        if "string" not in types:
            raise ConfigError(f"{source}: {_key_path(where)}: {value!r} cannot be read as {' or '.join(sorted(types))}")
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and types == {"string"}:
        return str(value)
    return value


def validate(config: dict, source: str = "config.yaml") -> dict:
    """Convert text values to the schema's types, validate against the JSON schema and fill
    defaults; returns a new dict."""
    import jsonschema

    if "recorded" in config:
        raise ConfigError(f"{source}: recorded: where results measured elsewhere are recorded is not part of "
                          "the config; expected them in reports/recorded.yaml (name: path)")
    schema = load_schema()
    config = coerce(copy.deepcopy(config), schema, schema, source=source)
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        err = _most_specific(errors[0])
        where = _key_path(err.absolute_path)
        raise ConfigError(f"{source}: {where}: {_describe(err)}")
    for key, sub in schema.get("properties", {}).items():
        if "default" in sub and key not in config:
            config[key] = copy.deepcopy(sub["default"])
    return config


def _most_specific(err):
    # oneOf/anyOf failures carry the per-branch errors in context; the deepest is the most telling.
    while err.context:
        err = max(err.context, key=lambda e: len(e.absolute_path))
    return err


def _describe(err) -> str:
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed)) if isinstance(err.instance, dict) else []
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        return f"unknown key(s) {', '.join(map(repr, extra))}{hint}"
    if err.validator in ("oneOf", "anyOf"):
        return f"{err.instance!r} is not valid here ({err.schema.get('description', err.message)})"
    return err.message


def check_blocks(blocks: int | str, n_layers: int, *, where: str) -> int | str:
    if blocks == "full":
        return blocks
    if not 1 <= int(blocks) <= 2 * n_layers:
        raise ConfigError(f"{where}: blocks N={blocks} must be 'full' or between 1 and 2L={2 * n_layers}")
    return int(blocks)


def preset_shape(name: str, *, where: str) -> dict:
    try:
        return presets.get_preset(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def resolve(config: dict, source: str = "config.yaml") -> dict:
    """The validated settings of the selected scale: ``base``, refined by the scale's block,
    overridden key by key by the top-level sections."""
    config = validate(config, source)
    scale = config["scale"]
    if scale not in config["scales"]:
        known = ", ".join(config["scales"])
        raise ConfigError(f"{source}: scale: {scale!r} is not a scale of this config; expected one of: {known}")
    overrides = {k: config[k] for k in SECTIONS if k in config}
    settings = deep_merge(deep_merge(config.get("base", {}), config["scales"][scale]), overrides)
    settings["scale"] = scale
    settings["results"] = f"{config.get('results', 'results')}/{scale}"
    _check_semantics(settings, f"{source}: scales.{scale}")
    _check_attention(config, settings, source)
    return settings


def _check_attention(config: dict, settings: dict, source: str) -> None:
    """Attention ``flash`` is refused here, not mid-forward, where flash-attn is not installed."""
    import importlib.util

    scale = settings["scale"]
    in_block = config["scales"][scale]
    for section in ("recipe", "throughput"):
        if (settings.get(section) or {}).get("attention") != "flash" or importlib.util.find_spec("flash_attn"):
            continue
        # the key the value comes from: a top-level section overrides the scale's block, which
        # refines `base`
        if (config.get(section) or {}).get("attention") == "flash":
            key = f"{section}.attention"
        elif (in_block.get(section) or {}).get("attention") == "flash":
            key = f"scales.{scale}.{section}.attention"
        else:
            key = f"base.{section}.attention"
        raise ConfigError(
            f"{source}: {key}: 'flash' needs the flash-attn package, which is not installed here "
            "(pip install '.[flash]', a CUDA build from source); expected auto, flex or sdpa, or install it")


def _check_semantics(settings: dict, where: str) -> None:
    def rank_ok(rank, d_model: int, *, where: str) -> int:
        return resolve_rank(rank, d_model, where=where, error=ConfigError)

    train = settings["train"]
    if "steps" not in train and "tokens" not in train:
        raise ConfigError(f"{where}.train: expected 'steps' or 'tokens'")
    shapes = {role: preset_shape(name, where=f"{where}.presets.{role}") for role, name in settings["presets"].items()}
    main = shapes["main"]
    grid = settings["grid"]
    for i, rank in enumerate(grid.get("ranks", [])):
        rank_ok(rank, main["d_model"], where=f"{where}.grid.ranks[{i}]")
    for i, blocks in enumerate(grid.get("blocks", [])):
        check_blocks(blocks, main["n_layers"], where=f"{where}.grid.blocks[{i}]")
    named = [(k, grid[k]) for k in ("headline", "control") if k in grid]
    named += [(f"projected[{i}]", p) for i, p in enumerate(grid.get("projected", []))]
    for key, run in named:
        rank_ok(run["rank"], main["d_model"], where=f"{where}.grid.{key}.rank")
        check_blocks(run["blocks"], main["n_layers"], where=f"{where}.grid.{key}.blocks")
    if "pair" in grid:
        for role in ("small", "large"):
            shape = shapes[role]
            rank_ok(grid["pair"]["rank"], shape["d_model"], where=f"{where}.grid.pair.rank ({role})")
            check_blocks(grid["pair"]["blocks"], shape["n_layers"], where=f"{where}.grid.pair.blocks ({role})")
    for rule in TIMING_RULES:
        if settings.get("resources", {}).get(rule, {}).get("jobs_per_gpu", 1) != 1:
            raise ConfigError(f"{where}.resources.{rule}.jobs_per_gpu: a timing job runs alone on its GPU; expected 1")
    acc = settings["accounting"]
    for role, shape in shapes.items():
        for i, rank in enumerate(acc.get("ranks", [])):
            rank_ok(rank, shape["d_model"], where=f"{where}.accounting.ranks[{i}] ({role})")
        for i, blocks in enumerate(acc.get("blocks", [])):
            check_blocks(blocks, shape["n_layers"], where=f"{where}.accounting.blocks[{i}] ({role})")
    try:
        batch.check(settings, where)
        memory.check(settings, where)
        jobplan.placement(settings)
        for preset in dict.fromkeys(settings["presets"].values()):  # the launch options torch has
            jobplan.launcher(settings, preset)
    except (batch.BatchError, memory.FitError) as e:
        raise ConfigError(str(e)) from None
    except jobplan.JobPlanError as e:
        raise ConfigError(f"{where}.{e}") from None


# Settings that say how and where a scale runs, not what it computes: changing them reruns nothing.
EXECUTION_KEYS = (("resources",), ("results",), ("data", "num_threads"), ("data", "hf", "local_dir"), ("cluster",),
                  ("train", "log_every_s"), ("train", "grad_guard"), ("train", "on_code_change"))
TIMING_RULES = ("throughput", "kernel_check")  # timed: always alone on their GPU


def science(settings: dict) -> dict:
    """The resolved settings without the execution settings (:data:`EXECUTION_KEYS`): what the
    stages that read a whole scale (``settings.json``) are given."""
    out = copy.deepcopy(settings)
    for path in EXECUTION_KEYS:
        node = out
        for key in path[:-1]:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


def load_and_resolve(path: str | Path = "config.yaml", overrides: dict | None = None) -> dict:
    raw = load_yaml(path)
    if overrides:
        raw = deep_merge(raw, overrides)
    return resolve(raw, source=str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lrattnres config", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config.yaml")
    parser.add_argument("--scale", help="override the config's scale")
    args = parser.parse_args(argv)
    overrides = {"scale": args.scale} if args.scale else None
    try:
        settings = load_and_resolve(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    json.dump(settings, sys.stdout, indent=2)
    print()
    return 0
