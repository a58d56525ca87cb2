"""What is timed: the cached tokens (the data stage's first training batches, or synthetic documents)
and each method's model on one shared initialisation of the backbone, with FLA's router as an
alternative where it imports."""

from __future__ import annotations

import math
from typing import Callable

from lrattnres.throughput.spec import METHOD_TABLE


def synthetic_buffer(n_batches: int, micro_batch: int, seq_len: int, vocab_size: int, eot_id: int,
                     doc_len_median: int, seed: int) -> list:
    """``n_batches`` Batches of random tokens with log-normal document lengths (sigma 1) ended by
    ``eot_id``; doc_ids and shifted targets exactly as ``lrattnres.data.loader`` builds them."""
    import numpy as np

    from lrattnres.data.loader import batch_from_rows

    rng = np.random.default_rng([seed, 4242])
    n = n_batches * micro_batch * (seq_len + 1)
    tokens = rng.integers(0, vocab_size, size=n, dtype=np.int64)
    tokens[tokens == eot_id] = (eot_id + 1) % vocab_size
    pos = 0
    while True:
        pos += max(1, int(rng.lognormal(math.log(doc_len_median), 1.0)))
        if pos > n:
            break
        tokens[pos - 1] = eot_id
    rows = tokens.reshape(n_batches, micro_batch, seq_len + 1)
    return [batch_from_rows(r, eot_id) for r in rows]


def data_buffer(manifest: dict, n_batches: int, micro_batch: int, seq_len: int, seed: int) -> list:
    """The first ``n_batches`` training batches of the data stage's loader (real tokens, real boundaries)."""
    from lrattnres.data import TokenLoader

    loader = TokenLoader(manifest, "train", micro_batch, seq_len, seed)
    return [next(loader) for _ in range(n_batches)]


def fla_available(device_type: str) -> tuple[bool, str]:
    """(True, version) where FLA's fused_attnres imports and the device is CUDA; else (False, why)."""
    if device_type != "cuda":
        return False, "FLA's fused_attnres runs on CUDA only"
    try:
        from fla.ops.attnres import fused_attnres  # noqa: F401
    except Exception as e:  # ImportError, or a Triton/driver error at import
        return False, f"fla does not import ({type(e).__name__}: {e})"
    try:
        from importlib.metadata import version

        return True, version("fla-core")
    except Exception:
        return True, "unknown version"


def fla_router(compile_safe: bool = False) -> Callable:
    """A router with the signature of ``kernels.attnres`` over FLA's ``fused_attnres``.

    Standard AttnRes only (FLA normalises the key over the full width): r must equal d and norm
    "slice" (with r = d the same as "full").  Weightless RMS: ``rms_weight = ones(d)``.  Under
    torch.compile the call is left out of the graph (``compile_safe``).
    """
    import torch
    from fla.ops.attnres import fused_attnres

    ones: dict = {}

    def route(sources, query, *, norm: str = "slice", eps: float = 1e-6):
        d = sources[0].shape[-1]
        if query.shape[-1] != d:
            raise ValueError(f"FLA's fused_attnres routes with r = d only; got r = {query.shape[-1]}, d = {d}")
        key = (query.device, query.dtype, d)
        if key not in ones:
            ones[key] = torch.ones(d, device=query.device, dtype=query.dtype)
        dt = sources[0].dtype  # FLA wants same-dtype sources (the model writes them in the embedding's dtype)
        srcs = [x if x.dtype == dt else x.to(dt) for x in sources]
        return fused_attnres(query, srcs, ones[key], rms_eps=eps)

    return torch.compiler.disable(route) if compile_safe else route


def method_config(preset: str, name: str, s: dict, vocab_size: int) -> dict:
    """Model-config dict of one method at one preset."""
    from lrattnres.presets import get_preset

    p = get_preset(preset)
    m = METHOD_TABLE[name]
    d = p["d_model"]
    cfg = {"preset": preset, "vocab_size": vocab_size, "method": m["method"], "attention": s["attention"],
           "max_seq_len": max(p["max_seq_len"], s["seq_len"])}
    if m["method"] != "baseline":
        cfg["blocks"] = min(s["blocks"], 2 * p["n_layers"])
        cfg["rank"] = d if m["rank"] == "d" else max(1, d // 4)
        cfg["router"] = "reference" if m["router"] == "reference" else "fused" if m["router"] == "fused" else "reference"
    else:
        cfg["router"] = "reference"
    return cfg


def shared_backbone(preset: str, s: dict, vocab_size: int, repeat: int, device) -> dict:
    """One shared initialisation of the backbone for a repeat: the baseline model's weights, seeded."""
    import torch

    from lrattnres.model import build_model

    torch.manual_seed(s["seed"] * 1_000_003 + repeat)
    with torch.device(device):
        model = build_model(method_config(preset, "baseline", s, vocab_size))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    return state


def matched_model(preset: str, name: str, s: dict, vocab_size: int, shared: dict, device):
    """The method's model with the shared backbone copied in and the queries zero (deterministic)."""
    import torch

    from lrattnres.model import build_model

    with torch.device(device):
        model = build_model(method_config(preset, name, s, vocab_size))
    missing, unexpected = model.load_state_dict(shared, strict=False)
    extra_ok = {"queries"}
    if unexpected or set(missing) - extra_ok:
        raise RuntimeError(f"shared backbone does not fit method {name!r}: missing {missing}, unexpected {unexpected}")
    if hasattr(model, "queries"):
        with torch.no_grad():
            model.queries.zero_()
    if METHOD_TABLE[name]["router"] == "fla":
        route = fla_router(compile_safe=s["compile"])
        model._fused_router = lambda dev: route  # the model's forward asks this for its router
    return model
