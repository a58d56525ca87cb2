"""TokenLoader and iter_eval_batches (lrattnres.data.loader)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrattnres.data import TokenLoader, iter_eval_batches, load_manifest, prepare
from lrattnres.data.loader import SplitTokens

try:
    from test_data import make_docs, write_jsonl
except ImportError:  # tests/ as a package
    from .test_data import make_docs, write_jsonl


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    write_jsonl(d / "c.jsonl", make_docs(400, seed=11))
    spec = {"source": "local", "local": {"glob": str(d / "c.jsonl")}, "val_tokens": 3000, "shard_tokens": 2500,
            "vocab": "compact"}
    prepare(spec, d / "data", progress=False)
    return load_manifest(d / "data")


def _rows(batch):
    return [tuple(r) for r in torch.cat([batch.inputs, batch.targets[:, -1:]], 1).tolist()]


def test_batch_shapes_and_targets(manifest):
    L = TokenLoader(manifest, "train", batch_size=3, seq_len=32, seed=0)
    b = next(L)
    assert b.inputs.shape == b.targets.shape == b.doc_ids.shape == (3, 32)
    assert b.inputs.dtype == torch.int64 and b.targets.dtype == torch.int64 and b.doc_ids.dtype == torch.int32
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert int(b.inputs.max()) < manifest["vocab_size"]
    # windows start on the seq_len grid of the concatenated shards (crossing shard boundaries)
    data = SplitTokens(manifest, "train")
    assert len(data.shards) >= 2
    for w in L.windows_for(0, 0):
        assert np.array_equal(data.read(int(w) * 32, 33)[:-1], b.inputs[list(L.windows_for(0, 0)).index(w)].numpy())


def test_determinism_and_seed(manifest):
    a = TokenLoader(manifest, "train", 4, 16, seed=3)
    b = TokenLoader(manifest, "train", 4, 16, seed=3)
    c = TokenLoader(manifest, "train", 4, 16, seed=4)
    ba = [next(a) for _ in range(5)]
    bb = [next(b) for _ in range(5)]
    bc = [next(c) for _ in range(5)]
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(ba, bb))
    assert not all(torch.equal(x.inputs, y.inputs) for x, y in zip(ba, bc))


def test_epoch_covers_every_window_once(manifest):
    L = TokenLoader(manifest, "train", 5, 64, seed=1)
    seen = np.concatenate([L.windows_for(0, i) for i in range(L.batches_per_epoch)])
    assert len(set(seen.tolist())) == len(seen) == L.batches_per_epoch * 5
    for _ in range(L.batches_per_epoch + 2):  # rolls over into epoch 1 with a new order
        next(L)
    assert L.epoch == 1 and L.index == 2
    assert not np.array_equal(L.windows_for(0, 0), L.windows_for(1, 0))


def test_restart_equality(manifest):
    a = TokenLoader(manifest, "train", 2, 24, seed=9)
    for _ in range(7):
        next(a)
    state = a.state_dict()
    expect = [next(a) for _ in range(30)]  # crosses an epoch boundary
    b = TokenLoader(manifest, "train", 2, 24, seed=9)
    b.load_state_dict(state)
    got = [next(b) for _ in range(30)]
    for x, y in zip(expect, got):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets) and torch.equal(x.doc_ids, y.doc_ids)
    with pytest.raises(ValueError, match="seq_len"):
        TokenLoader(manifest, "train", 2, 32, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        TokenLoader(manifest, "train", 2, 24, seed=1).load_state_dict(state)


def test_doc_ids_around_eot(manifest):
    eot = manifest["eot_id"]
    L = TokenLoader(manifest, "train", 8, 64, seed=0)
    b = next(L)
    x, d = b.inputs.numpy(), b.doc_ids.numpy()
    assert (x == eot).any()
    for row, ids in zip(x, d):
        assert ids[0] == 0
        for t in range(1, len(row)):
            assert ids[t] == ids[t - 1] + (1 if row[t - 1] == eot else 0)
        pos = np.flatnonzero(row == eot)
        for p in pos:  # the EOT belongs to the document it ends; the next token starts a new one
            if p > 0:
                assert ids[p] == ids[p - 1]
            if p + 1 < len(row):
                assert ids[p + 1] == ids[p] + 1


def test_ddp_ranks_union_equals_single_rank(manifest):
    world = 3
    single = TokenLoader(manifest, "train", 2 * world, 16, seed=5)
    ranks = [TokenLoader(manifest, "train", 2, 16, seed=5, rank=r, world_size=world) for r in range(world)]
    for _ in range(single.batches_per_epoch + 3):
        g = next(single)
        parts = [next(r) for r in ranks]
        union = sorted(sum((_rows(p) for p in parts), []))
        assert union == sorted(_rows(g))
        # ranks are disjoint within a step
        assert sum(len(set(_rows(p))) for p in parts) == len(set(_rows(g)))
    with pytest.raises(ValueError, match="rank"):
        TokenLoader(manifest, "train", 2, 16, seed=5, rank=3, world_size=3)


def test_iter_eval_batches_covers_split_once(manifest):
    data = SplitTokens(manifest, "val")
    ev = iter_eval_batches(manifest, "val", 7, 50)
    batches = list(ev)
    assert len(batches) == len(ev)
    targets = torch.cat([b.targets.reshape(-1) for b in batches]).numpy()
    inputs = torch.cat([b.inputs.reshape(-1) for b in batches]).numpy()
    n = ev.tokens_covered
    assert n == targets.size and ev.tokens_total == data.size and data.size - 1 - n < 50
    assert np.array_equal(targets, data.read(1, n)) and np.array_equal(inputs, data.read(0, n))
    again = list(iter_eval_batches(manifest, "val", 7, 50))
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(batches, again))
    assert len(list(iter_eval_batches(manifest, "val", 7, 50, max_batches=2))) == 2
    # ranks split the batches; together they cover the split once
    parts = [iter_eval_batches(manifest, "val", 7, 50, rank=r, world_size=2) for r in range(2)]
    assert sum(p.tokens_covered for p in parts) == n
    rows = sorted(tuple(r) for p in parts for b in p for r in b.inputs.tolist())
    assert rows == sorted(tuple(r) for b in batches for r in b.inputs.tolist())


def test_loader_errors(manifest, tmp_path):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TokenLoader(manifest, "val", 1000, 64, seed=0)
    with pytest.raises(ValueError, match="split"):
        TokenLoader(manifest, "test", 2, 16, seed=0)


def test_every_batch_carries_its_document_segments_built_on_the_host(manifest):
    """flash-attn's offsets come with the batch (computed once, on the CPU): they cut exactly where a
    row starts or a document id changes, and rows taken with head() get their own."""
    from lrattnres.segments import document_segments

    eot = int(manifest["eot_id"])
    batches = [next(TokenLoader(manifest, "train", batch_size=4, seq_len=64, seed=3))]
    batches += list(iter_eval_batches(manifest, "val", 4, 64))[:2]
    for b in batches:
        seg = b.segments
        assert seg.cu_seqlens.device.type == "cpu" and seg.cu_seqlens.dtype == torch.int32
        assert torch.equal(seg.cu_seqlens, document_segments(b.doc_ids).cu_seqlens)
        cu = seg.cu_seqlens.tolist()
        B, T = b.inputs.shape
        assert cu[0] == 0 and cu[-1] == B * T and seg.max_seqlen == max(np.diff(cu))
        flat = b.inputs.flatten().tolist()
        starts = {i for i in range(B * T) if i % T == 0 or flat[i - 1] == eot}
        assert set(cu[:-1]) == starts
        moved = b.to("meta")
        assert moved.segments.cu_seqlens.device.type == "meta" and moved.segments.max_seqlen == seg.max_seqlen
    first = batches[0].head(2)
    assert first.inputs.shape[0] == 2 and first.segments.cu_seqlens[-1] == 2 * 64
