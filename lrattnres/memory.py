"""The peak GPU memory of one training rank, estimated from measured anchors, and the check that
every size of a scale fits its GPUs.

One rank of a data-parallel training job holds (bytes, fp32 master weights as the trainer keeps them):

* weights 4 P and gradients 4 P. In a data-parallel job the gradients are views into DDP's
  gradient buckets (``gradient_as_bucket_view``), which DDP allocates once and keeps: the training
  peak counts them once, and the validation peak keeps them although the gradients are freed;
* optimiser state: Muon's momentum (4 bytes per Muon parameter) and AdamW's two moments (8 bytes per
  AdamW parameter); with ``shard_optimizer`` each rank keeps the state of the parameters it owns under
  ZeroRedundancyOptimizer's partition (largest parameter first, each to the least-loaded rank; one
  partition per optimiser), and the estimate takes the most loaded rank;
* activations of one micro-batch: ``micro_batch x (a L d + c)`` GiB, with ``a`` and ``c`` fitted to
  the scale's anchors (peaks measured on one GPU: ``cluster.memory_anchors``) after their weights,
  gradients and full optimiser state are taken off; ``a L d`` grows with the layers and the width,
  ``c`` (the logits of 2,048 tokens over the vocabulary) does not;
  with activation checkpointing (the model recomputes each layer in the backward) the layers keep only
  their boundary tensors, :data:`CHECKPOINT_BYTES` per token and model dimension per layer (the read
  entering the layer and its two writes' partial sums, in bf16; the baseline keeps only the read), plus
  one layer's activations ``a d`` while it is recomputed, and ``c``;
* ``cluster.memory_overhead_gib``: what an allocator's peak leaves out (CUDA context, NCCL buffers,
  fragmentation).

Validation keeps the weights, the optimiser state and DDP's buckets and adds ``val_batch_size``
sequences of logits (bf16, their fp32 copy and the fp32 log-softmax: 10 bytes per vocabulary entry
and token).

:func:`checkpointing` resolves each size's ``activation_checkpointing`` (``auto``: on where the size
would not fit without it and does with it). :func:`check` refuses a scale whose estimated peak of any
size exceeds ``cluster.gpu_memory_gib x (1 - cluster.memory_margin)``. ``python -m lrattnres memory
[--scale paper]`` (lrattnres/memory_cli.py) prints the estimates; ``--check <result.json> ...``
compares them with measurements of ``benchmarks/paper_scale_fit.py`` (:func:`compare`: each
measurement's error, a failure above :data:`CHECK_TOLERANCE`), leaving out the anchors the model is
fitted to.
"""

from __future__ import annotations

from typing import Any

from lrattnres import batch
from lrattnres.errors import UserError
from lrattnres.presets import PAPER_VOCAB, get_preset

GIB = 2**30
VAL_BYTES_PER_LOGIT = 10  # bf16 logits, their fp32 copy, fp32 log-softmax
# bytes per token and model dimension that a checkpointed layer keeps (bf16): the read entering it and
# its two writes' partial sums (routed methods), the residual sum alone (baseline)
CHECKPOINT_BYTES = {"routed": 6, "baseline": 2}
CHECK_TOLERANCE = 0.10  # the largest relative error of an estimate against a measurement it was not fitted to


class FitError(UserError, ValueError):
    """A training plan that does not fit its GPUs; the message names the field."""


def parameter_shapes(shape: dict, method: str = "lr", rank: int | None = None) -> tuple[list[int], list[int]]:
    """(Muon parameter sizes, AdamW parameter sizes) of a preset's model (lrattnres/train/optim.py's
    split: >=2-D body weights to Muon; embedding, head, queries to AdamW)."""
    L, d, m, V = shape["n_layers"], shape["d_model"], shape["d_ff"], shape["vocab_size"]
    muon = [3 * d * d, d * d, 2 * m * d, d * m] * L
    adam = [V * d, V * d]
    if method != "baseline":
        adam.append(2 * L * (rank or d))
    if method == "plr":
        muon += [(rank or d) * d, (rank or d) * m] * L + [(rank or d) * d]
    return muon, adam


def zero_partition(sizes: list[int], world: int) -> list[int]:
    """Total size per rank under ZeroRedundancyOptimizer's partition (largest first, least-loaded rank,
    the lowest index on ties)."""
    load = [0] * world
    for n in sorted(sizes, reverse=True):
        load[load.index(min(load))] += n
    return load


def static_bytes(shape: dict, *, world: int = 1, shard: bool = False, method: str = "lr", rank: int | None = None) -> dict:
    """Weights, gradients and optimiser state of one rank, in bytes."""
    muon, adam = parameter_shapes(shape, method, rank)
    p = sum(muon) + sum(adam)
    if shard and world > 1:
        # one partition per optimiser; the most loaded rank of their sum
        mu, ad = zero_partition(muon, world), zero_partition(adam, world)
        opt = max(4 * a + 8 * b for a, b in zip(mu, ad))
    else:
        opt = 4 * sum(muon) + 8 * sum(adam)
    return {"parameters": p, "weights": 4 * p, "grads": 4 * p, "optimizer": opt}


def _anchor_row(anchor: dict) -> tuple[float, float, float]:
    shape = get_preset(anchor["preset"])
    st = static_bytes(shape, method=anchor.get("method", "lr"))
    act = (anchor["peak_gib"] * GIB - st["weights"] - st["grads"] - st["optimizer"]) / anchor["micro_batch"] / GIB
    return shape["n_layers"] * shape["d_model"], 1.0, act


def activation_model(anchors: list[dict]) -> tuple[float, float]:
    """(a, c): activation GiB per sequence = a L d + c, least squares over the anchors (one anchor: c = 0)."""
    if not anchors:
        raise FitError("cluster.memory_anchors: expected at least one measured peak")
    rows = [_anchor_row(a) for a in anchors]
    if len({x for x, _, _ in rows}) < 2:
        x, _, y = rows[0]
        return y / x, 0.0
    n = len(rows)
    sx, sy = sum(r[0] for r in rows), sum(r[2] for r in rows)
    sxx, sxy = sum(r[0] ** 2 for r in rows), sum(r[0] * r[2] for r in rows)
    a = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return a, (sy - a * sx) / n


def estimate(shape: dict, *, micro_batch: int, seq_len: int, world: int, shard: bool, val_batch_size: int,
             cluster: dict, method: str = "lr", rank: int | None = None, ddp: bool | None = None,
             checkpointing: bool = False) -> dict[str, Any]:
    """The estimated training and validation peaks of one rank, in GiB, with their parts. ``ddp``: the
    rank's model is wrapped in DistributedDataParallel (default: ``world > 1``), whose gradient buckets
    stay allocated through validation; ``checkpointing``: activation checkpointing."""
    a, c = activation_model(cluster.get("memory_anchors", []))
    scale = seq_len / 2048  # the anchors are measured at 2,048 tokens per sequence
    st = static_bytes(shape, world=world, shard=shard, method=method, rank=rank)
    L, d = shape["n_layers"], shape["d_model"]
    if checkpointing:
        kept = CHECKPOINT_BYTES["baseline" if method == "baseline" else "routed"] * L * d * seq_len / GIB
        act = micro_batch * (kept + (a * d + c) * scale)
    else:
        act = micro_batch * (a * L * d + c) * scale
    over = float(cluster.get("memory_overhead_gib", 0.0))
    ddp = world > 1 if ddp is None else ddp
    buckets = st["grads"] if ddp else 0  # the gradients are bucket views: counted once in training
    train = (st["weights"] + st["grads"] + st["optimizer"]) / GIB + act + over
    val_logits = val_batch_size * seq_len * shape["vocab_size"] * VAL_BYTES_PER_LOGIT / GIB
    val = (st["weights"] + st["optimizer"] + buckets) / GIB + val_logits + over
    return {"weights_gib": st["weights"] / GIB, "grads_gib": st["grads"] / GIB, "optimizer_gib": st["optimizer"] / GIB,
            "buckets_gib": buckets / GIB, "activations_gib": act, "overhead_gib": over,
            "activation_checkpointing": bool(checkpointing), "train_peak_gib": train, "val_peak_gib": val,
            "peak_gib": max(train, val)}


def _limit(cluster: dict) -> float:
    return cluster["gpu_memory_gib"] * (1 - cluster.get("memory_margin", 0.0))


def _size_estimate(settings: dict, preset: str, checkpointing: bool) -> dict[str, Any]:
    shape = get_preset(preset)
    shape["vocab_size"] = shape["vocab_size"] or PAPER_VOCAB
    b = batch.split(settings, preset)
    # AttnRes (r = d), the widest routing of the scale's runs, stands for every method of the size
    return estimate(shape, micro_batch=b["micro_batch"], seq_len=settings["train"]["seq_len"], world=b["world"],
                    shard=b["shard_optimizer"], val_batch_size=b["val_batch_size"] or b["micro_batch"],
                    cluster=settings.get("cluster") or {}, method="attnres", rank=shape["d_model"],
                    checkpointing=checkpointing)


def _planned(settings: dict) -> bool:
    """Whether the scale's training runs on GPUs whose memory the scale's cluster settings describe."""
    cluster = settings.get("cluster") or {}
    gpus = int(settings.get("resources", {}).get("train", {}).get("gpu", 0) or 0)
    return bool(cluster.get("memory_anchors") and cluster.get("gpu_memory_gib")) and gpus >= 1


def checkpointing(settings: dict, preset: str) -> bool:
    """Whether runs of ``preset`` checkpoint their activations: the size's ``activation_checkpointing``
    (lrattnres/batch.py), with ``auto`` on only where the estimated peak without it would exceed the
    GPU less the margin (never where the scale plans no GPU memory; :func:`check` then refuses a size
    that does not fit even so)."""
    want = batch.split(settings, preset).get("activation_checkpointing", "auto")
    if want != "auto":
        return bool(want)
    if not _planned(settings):
        return False
    return _size_estimate(settings, preset, False)["peak_gib"] > _limit(settings["cluster"])


def plan(settings: dict) -> list[dict[str, Any]]:
    """The estimate of every size of the scale's training runs (empty without ``cluster`` anchors)."""
    cluster = settings.get("cluster") or {}
    if not cluster.get("memory_anchors") or not cluster.get("gpu_memory_gib"):
        return []
    presets = settings["presets"]
    limit = _limit(cluster)
    out = []
    for preset in dict.fromkeys(p for p in (presets.get("main"), presets.get("small"), presets.get("large")) if p):
        b = batch.split(settings, preset)
        ac = checkpointing(settings, preset)
        est = _size_estimate(settings, preset, ac)
        out.append({"preset": preset, "where": b["where"], "micro_batch": b["micro_batch"],
                    "grad_accum": b["grad_accum"], "world": b["world"], "shard_optimizer": b["shard_optimizer"],
                    "val_batch_size": b["val_batch_size"] or b["micro_batch"],
                    "activation_checkpointing_setting": b.get("activation_checkpointing", "auto"), **est,
                    "limit_gib": limit, "gpu_memory_gib": cluster["gpu_memory_gib"],
                    "margin": 1 - est["peak_gib"] / cluster["gpu_memory_gib"]})
    return out


def check(settings: dict, where: str) -> None:
    """Refuse a scale whose training jobs would not fit ``cluster.gpu_memory_gib`` with the margin."""
    if int(settings.get("resources", {}).get("train", {}).get("gpu", 0) or 0) < 1:
        return  # CPU training: no GPU budget
    for row in plan(settings):
        if row["peak_gib"] > row["limit_gib"]:
            what = "training" if row["train_peak_gib"] >= row["val_peak_gib"] else "validation"
            raise FitError(
                f"{where}.{row['where']}: {row['preset']} needs an estimated {row['peak_gib']:.1f} GiB per GPU "
                f"({what} peak: micro_batch {row['micro_batch']}, validation batch {row['val_batch_size']}, optimiser "
                f"state {'sharded over' if row['shard_optimizer'] else 'replicated on'} {row['world']} GPUs); "
                f"expected at most {row['limit_gib']:.1f} GiB (cluster.gpu_memory_gib {row['gpu_memory_gib']} less the "
                f"{100 * settings['cluster'].get('memory_margin', 0):.0f}% margin"
                + (", with activation checkpointing" if row["activation_checkpointing"] else "") + "): "
                + ("lower micro_batch (grad_accum auto raises the accumulation), set shard_optimizer: true"
                   + ("" if row["activation_checkpointing"] else " or activation_checkpointing: true (or auto)")
                   if what == "training" else "lower the validation batch size"))


def _is_anchor(m: dict, anchors: list[dict]) -> bool:
    """Whether measurement ``m`` is the configuration of one of the anchors the model is fitted to."""
    return any(a["preset"] == m["preset"] and a["micro_batch"] == m["micro_batch"]
               and a.get("method", "lr") == m["method"] and not (m.get("shard_optimizer") and m.get("world_planned", 1) > 1)
               and not m.get("activation_checkpointing") for a in anchors)


def compare(measurements: list[dict], cluster: dict, tolerance: float = CHECK_TOLERANCE) -> list[dict[str, Any]]:
    """The estimate beside each measurement of ``benchmarks/paper_scale_fit.py``'s memory part (its
    ``results.memory`` rows): for the training and the validation peak of one rank, the measured
    allocator peak (``torch.cuda.max_memory_allocated``), the estimate for the same configuration less
    the overhead (which the allocator's peak leaves out), and the relative error. A row of an anchor's
    configuration is marked ``fitted`` and is no check of the model; any other row fails (``ok``
    False) when the error exceeds ``tolerance``."""
    anchors = cluster.get("memory_anchors", [])
    out = []
    for m in measurements:
        if "train_peak_allocated_gib" not in m:
            out.append({"preset": m.get("preset"), "config": m.get("config"), "part": "-", "measured": None,
                        "note": m.get("error") or "no GPU peak measured"})
            continue
        shape = dict(get_preset(m.get("shape") or m["preset"]))
        shape["vocab_size"] = m.get("vocab") or shape["vocab_size"] or PAPER_VOCAB
        est = estimate(shape, micro_batch=m["micro_batch"], seq_len=m["seq_len"], world=m.get("world_planned", 1),
                       shard=bool(m.get("shard_optimizer")), val_batch_size=m["val_batch_size"], cluster=cluster,
                       method=m["method"], rank=m.get("rank"), ddp=bool(m.get("ddp")),
                       checkpointing=bool(m.get("activation_checkpointing")))
        fitted = _is_anchor(m, anchors)
        for part in ("train", "val"):
            measured = m.get(f"{part}_peak_allocated_gib")
            if measured is None:
                continue
            estimated = est[f"{part}_peak_gib"] - est["overhead_gib"]
            err = (estimated - measured) / measured
            out.append({"preset": m["preset"], "config": m.get("config"), "method": m["method"],
                        "micro_batch": m["micro_batch"], "shard_optimizer": bool(m.get("shard_optimizer")),
                        "ddp": bool(m.get("ddp")), "activation_checkpointing": bool(m.get("activation_checkpointing")),
                        "part": part, "measured_gib": measured, "estimated_gib": estimated, "error": err,
                        "fitted": fitted, "ok": fitted or abs(err) <= tolerance})
    return out


def throughput_estimate(shape: dict, *, micro_batch: int, seq_len: int, cluster: dict, method: str = "lr",
                        rank: int | None = None, shared_on_gpu: bool = False, idle_models: int = 0) -> dict[str, Any]:
    """The estimated peak GPU memory of the throughput stage (lrattnres/throughput/) timing one method,
    in GiB, with its parts.

    The timed update is one rank's training step on one GPU (:func:`estimate` with the full optimiser
    state: weights, gradients, Muon and AdamW state, the activations of one micro-batch, the overhead).
    The stage's layout adds what it keeps beside the timed model: the shared starting weights where
    they are on the GPU (``shared_on_gpu``: an fp32 copy, 4 bytes per parameter; the stage keeps them
    on the host) and the weights of ``idle_models`` other methods' models left on the GPU (the stage
    gives their memory back between runs)."""
    e = estimate(shape, micro_batch=micro_batch, seq_len=seq_len, world=1, shard=False, val_batch_size=1,
                 cluster=cluster, method=method, rank=rank)
    weights = e["weights_gib"]
    shared = weights if shared_on_gpu else 0.0
    idle = idle_models * weights
    return {"weights_gib": weights, "grads_gib": e["grads_gib"], "optimizer_gib": e["optimizer_gib"],
            "activations_gib": e["activations_gib"], "overhead_gib": e["overhead_gib"], "shared_weights_gib": shared,
            "idle_models_gib": idle, "peak_gib": e["train_peak_gib"] + shared + idle}


def check_throughput(rows: list[dict], cluster: dict, where: str, memory_of: str = "cluster.gpu_memory_gib") -> None:
    """Refuse a throughput plan (rows of ``preset``, ``method`` and :func:`throughput_estimate`'s
    ``peak_gib``) whose estimated peak exceeds ``cluster.gpu_memory_gib`` less ``cluster.memory_margin``
    (``memory_of`` names where that memory comes from in the message)."""
    limit = cluster["gpu_memory_gib"] * (1 - cluster.get("memory_margin", 0.0))
    for row in rows:
        if row["peak_gib"] > limit:
            raise FitError(
                f"{where}: timing {row['method']} at {row['preset']} needs an estimated {row['peak_gib']:.1f} GiB "
                f"(micro_batch {row['micro_batch']} x {row['seq_len']}: weights {row['weights_gib']:.1f}, gradients "
                f"{row['grads_gib']:.1f}, optimiser state {row['optimizer_gib']:.1f}, activations "
                f"{row['activations_gib']:.1f}, overhead {row['overhead_gib']:.1f}"
                + (f", shared starting weights {row['shared_weights_gib']:.1f}" if row["shared_weights_gib"] else "")
                + (f", idle models {row['idle_models_gib']:.1f}" if row["idle_models_gib"] else "")
                + f" GiB); expected at most {limit:.1f} GiB ({memory_of} {cluster['gpu_memory_gib']:g} less "
                f"the {100 * cluster.get('memory_margin', 0.0):.0f}% margin): a smaller micro_batch with a larger "
                "grad_accum keeps the tokens per update, or time it on a GPU with more memory")
