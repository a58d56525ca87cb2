"""Load, validate and resolve config.yaml into the settings of one scale.

The raw config is validated against ``workflow/schemas/config.schema.yaml`` (so a typo in a key is an
error, not a silently ignored setting), then the selected scale's block is merged with the top-level
overrides, then semantic checks that need the model presets run (a rank wider than the model, more
blocks than writes) or the installed packages (attention ``flash`` needs flash-attn, the optional
``flash`` extra; the check runs in the Python that checks the config, e.g. Snakemake's).  Every error
names the file, the key and what was expected.

``python -m lrattnres config [--config config.yaml] [--scale tiny]`` prints the resolved settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

import yaml

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
)


class ConfigError(ValueError):
    """A config that cannot be run; the message names the file, the key and the expectation."""


def deep_merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; ``override`` wins; neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


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


def validate(config: dict, source: str = "config.yaml") -> dict:
    """Validate against the JSON schema and fill defaults; returns a new dict."""
    import jsonschema

    config = copy.deepcopy(config)
    schema = load_schema()
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


_RANK = re.compile(r"^d(?:/(\d+))?$")


def resolve_rank(rank: int | str, d_model: int, *, where: str) -> int:
    """``128`` -> 128; ``"d/8"`` -> d_model // 8; ``"d"`` -> d_model. Checks 1 <= r <= d."""
    if isinstance(rank, str):
        m = _RANK.match(rank)
        if not m:
            raise ConfigError(f"{where}: rank {rank!r} is not an integer or 'd/<k>'")
        k = int(m.group(1) or 1)
        if d_model % k:
            raise ConfigError(f"{where}: rank {rank!r} does not divide the width d={d_model}")
        value = d_model // k
    else:
        value = int(rank)
    if not 1 <= value <= d_model:
        raise ConfigError(f"{where}: rank {rank!r} = {value} must be between 1 and the width d={d_model}")
    return value


def check_blocks(blocks: int | str, n_layers: int, *, where: str) -> int | str:
    if blocks == "full":
        return blocks
    if not 1 <= int(blocks) <= 2 * n_layers:
        raise ConfigError(f"{where}: blocks N={blocks} must be 'full' or between 1 and 2L={2 * n_layers}")
    return int(blocks)


def preset_shape(name: str, *, where: str) -> dict:
    from lrattnres import presets

    try:
        return presets.get_preset(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def resolve(config: dict, source: str = "config.yaml") -> dict:
    """The validated settings of the selected scale, with top-level overrides applied."""
    config = validate(config, source)
    scale = config["scale"]
    if scale not in config["scales"]:
        known = ", ".join(config["scales"])
        raise ConfigError(f"{source}: scale: {scale!r} is not a scale of this config; expected one of: {known}")
    block = config["scales"][scale]
    overrides = {k: config[k] for k in SECTIONS if k in config and k != "recipe"}
    settings = deep_merge(block, overrides)
    # The shared recipe is the base; a scale's own recipe block refines it.
    settings["recipe"] = deep_merge(config.get("recipe", {}), block.get("recipe", {}))
    settings["scale"] = scale
    settings["results"] = f"{config.get('results', 'results')}/{scale}"
    settings["recorded"] = dict(config.get("recorded", {}))
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
        # the key where the value comes from: a scale's recipe refines the shared one; a top-level
        # section overrides the scale's
        scale_key = (in_block.get(section) or {}).get("attention") == "flash"
        top_key = (config.get(section) or {}).get("attention") == "flash"
        from_scale = scale_key if section == "recipe" else not top_key
        key = f"scales.{scale}.{section}.attention" if from_scale else f"{section}.attention"
        raise ConfigError(
            f"{source}: {key}: 'flash' needs the flash-attn package, which is not installed here "
            "(pip install '.[flash]', a CUDA build from source); expected auto, flex or sdpa, or install it")


def _check_semantics(settings: dict, where: str) -> None:
    train = settings["train"]
    if "steps" not in train and "tokens" not in train:
        raise ConfigError(f"{where}.train: expected 'steps' or 'tokens'")
    shapes = {role: preset_shape(name, where=f"{where}.presets.{role}") for role, name in settings["presets"].items()}
    main = shapes["main"]
    grid = settings["grid"]
    for i, rank in enumerate(grid.get("ranks", [])):
        resolve_rank(rank, main["d_model"], where=f"{where}.grid.ranks[{i}]")
    for i, blocks in enumerate(grid.get("blocks", [])):
        check_blocks(blocks, main["n_layers"], where=f"{where}.grid.blocks[{i}]")
    named = [(k, grid[k]) for k in ("headline", "control") if k in grid]
    named += [(f"projected[{i}]", p) for i, p in enumerate(grid.get("projected", []))]
    for key, run in named:
        resolve_rank(run["rank"], main["d_model"], where=f"{where}.grid.{key}.rank")
        check_blocks(run["blocks"], main["n_layers"], where=f"{where}.grid.{key}.blocks")
    if "pair" in grid:
        for role in ("small", "large"):
            shape = shapes[role]
            resolve_rank(grid["pair"]["rank"], shape["d_model"], where=f"{where}.grid.pair.rank ({role})")
            check_blocks(grid["pair"]["blocks"], shape["n_layers"], where=f"{where}.grid.pair.blocks ({role})")
    acc = settings["accounting"]
    for role, shape in shapes.items():
        for i, rank in enumerate(acc.get("ranks", [])):
            resolve_rank(rank, shape["d_model"], where=f"{where}.accounting.ranks[{i}] ({role})")
        for i, blocks in enumerate(acc.get("blocks", [])):
            check_blocks(blocks, shape["n_layers"], where=f"{where}.accounting.blocks[{i}] ({role})")


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
