"""The peak GPU memory of one training rank, estimated from measured anchors, and the check that
every size of a scale fits its GPUs.

One rank of a data-parallel training job holds (bytes, fp32 master weights as the trainer keeps them):

* weights 4 P and gradients 4 P (DDP's buckets are the gradients: ``gradient_as_bucket_view``);
* optimiser state: Muon's momentum (4 bytes per Muon parameter) and AdamW's two moments (8 bytes per
  AdamW parameter); with ``shard_optimizer`` each rank keeps the state of the parameters it owns under
  ZeroRedundancyOptimizer's partition (largest parameter first, each to the least-loaded rank; one
  partition per optimiser), and the estimate takes the most loaded rank;
* activations of one micro-batch: ``micro_batch x (a L d + c)`` GiB, with ``a`` and ``c`` fitted to
  the scale's anchors (peaks measured on one GPU: ``cluster.memory_anchors``) after their weights,
  gradients and full optimiser state are taken off; ``a L d`` grows with the layers and the width,
  ``c`` (the logits of 2,048 tokens over the vocabulary) does not;
* ``cluster.memory_overhead_gib``: what an allocator's peak leaves out (CUDA context, NCCL buffers,
  fragmentation).

Validation keeps the weights and the optimiser state and adds ``val_batch_size`` sequences of logits
(bf16, their fp32 copy and the fp32 log-softmax: 10 bytes per vocabulary entry and token).

:func:`check` refuses a scale whose estimated peak of any size exceeds ``cluster.gpu_memory_gib x
(1 - cluster.memory_margin)``. ``python -m lrattnres memory [--scale paper]`` prints the estimates.
``benchmarks/paper_scale_fit.py`` measures one rank's exact configuration on a GPU to confirm them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lrattnres.errors import UserError

GIB = 2**30
VAL_BYTES_PER_LOGIT = 10  # bf16 logits, their fp32 copy, fp32 log-softmax


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
    from lrattnres.presets import get_preset

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
             cluster: dict, method: str = "lr", rank: int | None = None) -> dict[str, Any]:
    """The estimated training and validation peaks of one rank, in GiB, with their parts."""
    a, c = activation_model(cluster.get("memory_anchors", []))
    scale = seq_len / 2048  # the anchors are measured at 2,048 tokens per sequence
    st = static_bytes(shape, world=world, shard=shard, method=method, rank=rank)
    act = micro_batch * (a * shape["n_layers"] * shape["d_model"] + c) * scale
    over = float(cluster.get("memory_overhead_gib", 0.0))
    train = (st["weights"] + st["grads"] + st["optimizer"]) / GIB + act + over
    val_logits = val_batch_size * seq_len * shape["vocab_size"] * VAL_BYTES_PER_LOGIT / GIB
    val = (st["weights"] + st["optimizer"]) / GIB + val_logits + over
    return {"weights_gib": st["weights"] / GIB, "grads_gib": st["grads"] / GIB, "optimizer_gib": st["optimizer"] / GIB,
            "activations_gib": act, "overhead_gib": over, "train_peak_gib": train, "val_peak_gib": val,
            "peak_gib": max(train, val)}


def plan(settings: dict) -> list[dict[str, Any]]:
    """The estimate of every size of the scale's training runs (empty without ``cluster`` anchors)."""
    from lrattnres import batch
    from lrattnres.presets import PAPER_VOCAB, get_preset

    cluster = settings.get("cluster") or {}
    if not cluster.get("memory_anchors") or not cluster.get("gpu_memory_gib"):
        return []
    presets = settings["presets"]
    limit = cluster["gpu_memory_gib"] * (1 - cluster.get("memory_margin", 0.0))
    out = []
    for preset in dict.fromkeys(p for p in (presets.get("main"), presets.get("small"), presets.get("large")) if p):
        shape = get_preset(preset)
        shape["vocab_size"] = shape["vocab_size"] or PAPER_VOCAB
        b = batch.split(settings, preset)
        est = estimate(shape, micro_batch=b["micro_batch"], seq_len=settings["train"]["seq_len"], world=b["world"],
                       shard=b["shard_optimizer"], val_batch_size=b["val_batch_size"] or b["micro_batch"],
                       cluster=cluster, method="attnres", rank=shape["d_model"])
        out.append({"preset": preset, "where": b["where"], "micro_batch": b["micro_batch"],
                    "grad_accum": b["grad_accum"], "world": b["world"], "shard_optimizer": b["shard_optimizer"],
                    "val_batch_size": b["val_batch_size"] or b["micro_batch"], **est,
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
                f"{100 * settings['cluster'].get('memory_margin', 0):.0f}% margin): "
                + ("lower micro_batch (grad_accum auto raises the accumulation) or set shard_optimizer: true"
                   if what == "training" else "lower the validation batch size"))


def main(argv: list[str] | None = None) -> int:
    from lrattnres.config import load_and_resolve

    p = argparse.ArgumentParser(prog="python -m lrattnres memory", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--scale", default="paper")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    rows = plan(load_and_resolve(args.config, {"scale": args.scale}))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"scale {args.scale!r} has no cluster.memory_anchors: nothing to estimate", file=sys.stderr)
        return 0
    print("| size | micro-batch x accumulation x GPUs | optimiser | weights+grads | optimiser state | activations "
          "| training peak | validation peak | of the GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['micro_batch']} x {r['grad_accum']} x {r['world']} | "
              f"{'sharded' if r['shard_optimizer'] else 'replicated'} | {r['weights_gib'] + r['grads_gib']:.1f} GiB | "
              f"{r['optimizer_gib']:.1f} GiB | {r['activations_gib']:.1f} GiB | {r['train_peak_gib']:.1f} GiB | "
              f"{r['val_peak_gib']:.1f} GiB | {100 * r['peak_gib'] / r['gpu_memory_gib']:.0f}% |")
    return 0


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
