"""What is timed: the cached tokens (the data stage's first training batches, or synthetic documents)
and each method's model on one shared initialisation of the backbone, with FLA's router as an
alternative where it imports."""

from __future__ import annotations

import math
from typing import Callable

from lrattnres.data import TokenLoader
from lrattnres.data.loader import batch_from_rows
from lrattnres.presets import get_preset
from lrattnres.ranks import resolve_rank
from lrattnres.throughput.spec import METHOD_TABLE


def synthetic_buffer(n_batches: int, micro_batch: int, seq_len: int, vocab_size: int, eot_id: int,
                     doc_len_median: int, seed: int) -> list:
    """``n_batches`` Batches of random tokens with log-normal document lengths (sigma 1) ended by
    ``eot_id``; doc_ids and shifted targets exactly as ``lrattnres.data.loader`` builds them."""
    import numpy as np

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
    p = get_preset(preset)
    m = METHOD_TABLE[name]
    d = p["d_model"]
    cfg = {"preset": preset, "vocab_size": vocab_size, "method": m["method"], "attention": s["attention"],
           "max_seq_len": max(p["max_seq_len"], s["seq_len"])}
    if m["method"] != "baseline":
        cfg["blocks"] = min(s["blocks"], 2 * p["n_layers"])
        cfg["rank"] = resolve_rank(m["rank"], d, where=f"throughput method {name!r}")
        cfg["router"] = "reference" if m["router"] == "reference" else "fused" if m["router"] == "fused" else "reference"
    else:
        cfg["router"] = "reference"
    return cfg


def shared_backbone(preset: str, s: dict, vocab_size: int, repeat: int, device, into: dict | None = None) -> dict:
    """One shared initialisation of the backbone for a repeat: the baseline model's weights, seeded.

    Generated on ``device`` (the same random stream as a model built there) and kept on the host, in
    fp32, pinned where ``device`` is CUDA: no copy of the weights stays on the GPU beside the timed
    model (at 4B a second fp32 copy is 15 GiB). ``into``: the host tensors of an earlier repeat,
    overwritten (a pinned buffer is allocated once per size)."""
    import torch

    from lrattnres.model import build_model

    torch.manual_seed(s["seed"] * 1_000_003 + repeat)
    with torch.device(device):
        model = build_model(method_config(preset, "baseline", s, vocab_size))
    pin = getattr(device, "type", str(device)) == "cuda"
    state = {}
    for k, v in model.state_dict().items():
        host = (into or {}).get(k)
        if host is None or host.shape != v.shape or host.dtype != v.dtype:
            host = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin)
        host.copy_(v.detach())
        state[k] = host
    del model
    return state


def build_method_model(preset: str, name: str, s: dict, vocab_size: int, device):
    """The method's model on ``device`` (its own initialisation, overwritten by :func:`load_shared`),
    with FLA's router wired in for ``fla-rd``."""
    import torch

    from lrattnres.model import build_model

    with torch.device(device):
        model = build_model(method_config(preset, name, s, vocab_size))
    if METHOD_TABLE[name]["router"] == "fla":
        route = fla_router(compile_safe=s["compile"])
        model._fused_router = lambda dev: route  # the model's forward asks this for its router
    return model


def release_weights(model) -> None:
    """Give back the device memory of the model's parameters and gradients, keeping every tensor
    object (a compiled graph of the model stays valid: its guards see the same parameters, which
    :func:`load_shared` fills again before the next use)."""
    for p in model.parameters():
        p.grad = None
        st = p.untyped_storage()
        if st.nbytes() and p.is_contiguous() and p.storage_offset() == 0:
            st.resize_(0)


def _restore(model) -> None:
    for p in model.parameters():
        need = p.numel() * p.element_size()
        st = p.untyped_storage()
        if st.nbytes() < need:
            st.resize_(need)


def load_shared(model, name: str, shared: dict) -> None:
    """Copy the shared backbone (host tensors) into the model's own parameters, in place, and zero
    the routing queries: the matched starting point of a repeat, without building or compiling anew."""
    import torch

    _restore(model)
    missing, unexpected = model.load_state_dict(shared, strict=False)  # copies into the existing tensors
    extra_ok = {"queries"}
    if unexpected or set(missing) - extra_ok:
        raise RuntimeError(f"shared backbone does not fit method {name!r}: missing {missing}, unexpected {unexpected}")
    if hasattr(model, "queries"):
        with torch.no_grad():
            model.queries.zero_()
    for p in model.parameters():
        p.grad = None


def matched_model(preset: str, name: str, s: dict, vocab_size: int, shared: dict, device):
    """The method's model with the shared backbone copied in and the queries zero (deterministic)."""
    model = build_method_model(preset, name, s, vocab_size, device)
    load_shared(model, name, shared)
    return model
