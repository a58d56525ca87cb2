"""``vocab_max``: a frequency-capped compact vocabulary for the small scales (the output layer dominates
a tiny model's cost)."""

from __future__ import annotations

import numpy as np
import pytest
from test_data import make_docs, write_jsonl

from lrattnres.data import SpecError, load_manifest, load_tokenizer, prepare, validate_spec
from lrattnres.data.manifest import open_shard, shard_paths
from lrattnres.data.loader import TokenLoader


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    d = tmp_path_factory.mktemp("capped")
    docs = make_docs(200)
    write_jsonl(d / "a.jsonl", docs)
    base = {"source": "local", "local": {"glob": str(d / "*.jsonl")}, "val_tokens": 800, "shard_tokens": 4000, "vocab": "compact"}
    prepare(base, d / "all", progress=False)
    prepare({**base, "vocab_max": 32}, d / "cap", progress=False)
    return docs, load_manifest(d / "all" / "manifest.json"), load_manifest(d / "cap" / "manifest.json")


def test_cap_keeps_the_most_frequent_ids_plus_unk(capped):
    _, full, cap = capped
    assert full["vocab_size"] > 32
    assert cap["vocab_size"] == 32
    assert cap["unk_id"] == 31 and cap["eot_id"] < 31
    frac = cap["vocab_map"]["unk_token_fraction"]
    assert 0 < frac < 1
    # the kept ids are the most frequent ones: every kept id is at least as frequent as any UNK'd one
    def original_tokens(m):
        tok = load_tokenizer(m)
        parts = [tok.to_original_ids(np.asarray(open_shard(path, n))) for split in ("val", "train") for path, n in shard_paths(m, split)]
        return np.concatenate(parts)

    ids_full, ids_cap = original_tokens(full), original_tokens(cap)
    assert ids_full.shape == ids_cap.shape
    counts = np.bincount(ids_full)
    unk = ids_cap < 0
    assert (ids_cap[~unk] == ids_full[~unk]).all()
    assert counts[ids_full[~unk]].min() >= counts[ids_full[unk]].max()


def test_capped_shards_use_only_the_capped_ids(capped):
    _, _, cap = capped
    loader = TokenLoader(cap, "train", batch_size=2, seq_len=16, seed=0)
    batch = next(iter(loader))
    assert int(batch.inputs.max()) < cap["vocab_size"]


def test_cap_needs_compact():
    with pytest.raises(SpecError, match="vocab_max"):
        validate_spec({"vocab": "full", "vocab_max": 100})
