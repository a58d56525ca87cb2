"""Data stage: tokenizer, sources, shards, manifest validation, compaction (lrattnres.data)."""

from __future__ import annotations

import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest

from lrattnres.data import (
    EOT,
    ManifestError,
    SpecError,
    Tokenizer,
    doc_ends,
    get_encoding,
    load_manifest,
    load_tokenizer,
    prepare,
    validate_spec,
)
from lrattnres.data import cli, shards, sources
from lrattnres.data.tokenizer import EXPECTED_SHA256, N_VOCAB

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can said who what "
    "model layer residual attention depth query key value token document routing weight sum block rank "
    "Zürich naïve café über 2048 3.14 (x) [y] {z} -- ; : ! ? \u4e2d\u6587 emoji \U0001F600"
).split()


def make_docs(n: int, seed: int = 0, empty_every: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            docs.append("" if i % 2 else "   \n")
            continue
        k = rng.randint(3, 120)
        words = [rng.choice(WORDS) for _ in range(k)]
        docs.append(f"Doc {i}: " + " ".join(words) + ".")
    return docs


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def write_parquet(path, docs, column):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path)


def split_docs(m, split):
    """Decoded documents of a split (texts without the EOT), via the document index."""
    from lrattnres.data.loader import SplitTokens

    tk = load_tokenizer(m)
    data = SplitTokens(m, split)
    ends = doc_ends(m, split)
    starts = np.concatenate([[0], ends[:-1]])
    out = []
    for a, b in zip(starts, ends):
        ids = data.read(int(a), int(b - a))
        assert ids[-1] == m["eot_id"]
        out.append(tk.decode(ids[:-1].tolist()))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A local jsonl corpus (with empty documents) built twice: full and compact vocabulary."""
    d = tmp_path_factory.mktemp("corpus")
    docs = make_docs(240, empty_every=40)
    write_jsonl(d / "a.jsonl", docs[:120])
    write_jsonl(d / "b.jsonl", docs[120:])
    base = {"source": "local", "local": {"glob": str(d / "*.jsonl")}, "val_tokens": 1500, "shard_tokens": 2000}
    full = prepare(base, d / "full", progress=False)
    compact = prepare({**base, "vocab": "compact"}, d / "compact", progress=False)
    return {"docs": docs, "dir": d, "spec": base, "full": full, "compact": compact}


# -- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_facts():
    enc = get_encoding()
    assert enc.n_vocab == N_VOCAB == 100_277
    assert enc.encode_ordinary("hello world") == [15339, 1917]
    assert enc.eot_token == EOT == 100_257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [100_257]
    assert enc.encode("<|endofprompt|>", allowed_special="all") == [100_276]
    assert [enc.encode(t, allowed_special="all")[0] for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")] == [
        100_258, 100_259, 100_260]
    # special-token text inside a document is ordinary text
    assert EOT not in enc.encode_ordinary("a <|endoftext|> b")
    assert EXPECTED_SHA256 == "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
    tk = Tokenizer()
    assert tk.encode("hello world", eot=True) == [15339, 1917, EOT]
    assert tk.decode([15339, 1917]) == "hello world"


# -- sources -----------------------------------------------------------------------------------


def test_embedded_deterministic(tmp_path):
    spec = {"embedded": {"packages": ["json", "email"], "max_documents": 25, "workers": 2},
            "val_tokens": 1000, "shard_tokens": 1500}
    a = prepare(spec, tmp_path / "a", progress=False)
    b = prepare({**spec, "embedded": {**spec["embedded"], "workers": 1}}, tmp_path / "b", progress=False)
    assert a["source"]["content_sha256"] == b["source"]["content_sha256"]
    assert [s["sha256"] for s in a["splits"]["train"]["shards"]] == [s["sha256"] for s in b["splits"]["train"]["shards"]]
    assert a["counts"]["documents"] == 25
    pk = {p["name"]: p for p in a["source"]["packages"]}
    assert pk["email"]["version"] and pk["email"]["license"]
    docs = split_docs(a, "val") + split_docs(a, "train")
    assert all(len(d) > 200 for d in docs)
    # extraction does not import the packages it reads
    assert sources.package_files("json")[1][0] == "__init__.py"


def test_embedded_missing_package(tmp_path):
    with pytest.raises(ValueError, match="not_a_pkg_xyz"):
        prepare({"embedded": {"packages": ["not_a_pkg_xyz"], "missing": "error"}}, tmp_path / "x", progress=False)


def test_local_formats(tmp_path):
    docs = make_docs(30, seed=3)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    write_jsonl(tmp_path / "c.jsonl", docs, field="body")
    write_parquet(tmp_path / "c.parquet", docs, "body")
    common = {"source": "local", "val_tokens": 200, "shard_tokens": 300}
    ms = {
        "txt": prepare({**common, "local": {"glob": str(tmp_path / "txt" / "*.txt")}}, tmp_path / "o1", progress=False),
        "jsonl": prepare({**common, "local": {"glob": str(tmp_path / "*.jsonl"), "field": "body"}}, tmp_path / "o2", progress=False),
        "parquet": prepare({**common, "local": {"glob": str(tmp_path / "*.parquet"), "format": "parquet", "field": "body"}},
                           tmp_path / "o3", progress=False),
    }
    shas = {k: m["source"]["content_sha256"] for k, m in ms.items()}
    assert len(set(shas.values())) == 1, shas
    # no split of its own: the documents are permuted with the seed (0) before the split
    permuted = [docs[i] for i in np.random.default_rng(0).permutation(len(docs))]
    for m in ms.values():
        assert m["counts"]["documents"] == 30 and m["shuffled"]
        assert split_docs(m, "val") + split_docs(m, "train") == permuted
    with pytest.raises(ValueError, match="c.jsonl:1: field .text. missing"):
        prepare({**common, "local": {"glob": str(tmp_path / "*.jsonl")}}, tmp_path / "o4", progress=False)


def _standin(tmp_path, n=120):
    docs = make_docs(n, seed=7, empty_every=25)
    files = []
    for k in range(3):
        p = tmp_path / f"ultrafineweb_en_{k}.parquet"
        write_parquet(p, docs[k * n // 3:(k + 1) * n // 3], "content")
        files.append(str(p))
    return docs, files


def test_hf_standin_and_resume(tmp_path, monkeypatch):
    docs, files = _standin(tmp_path)
    spec = {"source": "hf", "hf": {"dataset": "parquet", "data_files": {"en": files}, "split": "en",
                                   "column": "content"}, "val_tokens": 800, "shard_tokens": 700}
    ref = prepare(spec, tmp_path / "ref", progress=False)
    assert ref["source"]["kind"] == "hf" and ref["source"]["split"] == "en"
    assert ref["counts"]["empty_skipped"] == 4
    assert ref["counts"]["documents_consumed"] == 120
    nonempty = [d for d in docs if d.strip()]
    assert split_docs(ref, "val") + split_docs(ref, "train") == nonempty

    # interrupt after 70 rows, then resume: the written shards are kept and the stream restarts
    # from its stored state (IterableDataset.state_dict), not from the first row
    real = sources.HFSource.load_dataset
    read = {"rows": 0, "limit": 70, "loaded_state": None}

    class Boom(RuntimeError):
        pass

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, st):
            read["loaded_state"] = st
            self.inner.load_state_dict(st)

        def __iter__(self):
            for row in self.inner:
                read["rows"] += 1
                if read["limit"] and read["rows"] > read["limit"]:
                    raise Boom("interrupted")
                yield row

    monkeypatch.setattr(sources.HFSource, "load_dataset", staticmethod(lambda *a, **k: Counting(real(*a, **k))))
    monkeypatch.setattr(shards, "CHUNK_DOCS", 8)
    with pytest.raises(Boom):
        prepare(spec, tmp_path / "res", progress=False)
    progress = json.loads((tmp_path / ".res.partial" / "progress.json").read_text())
    consumed = progress["docs_consumed"]
    assert 0 < consumed <= 70 and progress["resume"]["state"] is not None
    assert not (tmp_path / "res").exists()
    read.update(rows=0, limit=None)
    res = prepare(spec, tmp_path / "res", progress=False)
    assert read["loaded_state"] == progress["resume"]["state"]
    assert read["rows"] == 120 - consumed + progress["resume"]["offset"]  # at most one chunk re-read
    assert progress["resume"]["offset"] <= 8
    for split in ("val", "train"):
        assert [s["sha256"] for s in res["splits"][split]["shards"]] == [s["sha256"] for s in ref["splits"][split]["shards"]]
    assert res["source"]["content_sha256"] == ref["source"]["content_sha256"]
    assert res["counts"] == ref["counts"]


def test_local_resume_by_count(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", make_docs(90, seed=2))
    spec = {"source": "local", "local": {"glob": str(tmp_path / "c.jsonl")}, "val_tokens": 600,
            "shard_tokens": 500, "vocab": "compact", "shuffle": False}
    ref = prepare(spec, tmp_path / "ref", progress=False)
    real = sources.LocalSource.iter_docs

    def flaky(self, skip=0):
        for i, t in enumerate(real(self, skip)):
            if i == 60:
                raise KeyboardInterrupt
            yield t

    monkeypatch.setattr(sources.LocalSource, "iter_docs", flaky)
    monkeypatch.setattr(shards, "CHUNK_DOCS", 8)
    with pytest.raises(KeyboardInterrupt):
        prepare(spec, tmp_path / "res", progress=False)
    progress = json.loads((tmp_path / ".res.partial" / "progress.json").read_text())
    assert progress["resume"] == {"state": None, "offset": progress["docs_consumed"]} and progress["docs_consumed"] > 0
    monkeypatch.setattr(sources.LocalSource, "iter_docs", real)
    res = prepare(spec, tmp_path / "res", progress=False)
    assert res["splits"] == ref["splits"] and res["counts"] == ref["counts"]
    assert np.array_equal(np.load(tmp_path / "res" / "vocab.npy"), np.load(tmp_path / "ref" / "vocab.npy"))

    # a changed input file invalidates the partial build: it starts afresh instead of mixing corpora
    monkeypatch.setattr(sources.LocalSource, "iter_docs", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare(spec, tmp_path / "new", progress=False)
    monkeypatch.setattr(sources.LocalSource, "iter_docs", real)
    new_docs = make_docs(90, seed=4)
    write_jsonl(tmp_path / "c.jsonl", new_docs)
    new = prepare(spec, tmp_path / "new", progress=False)
    assert split_docs(new, "val") + split_docs(new, "train") == new_docs


def test_shuffled_resume_and_identical_rebuild(tmp_path, monkeypatch):
    """An interrupted shuffled build resumes to the same shards; two builds give the same manifest bytes."""
    write_jsonl(tmp_path / "c.jsonl", make_docs(90, seed=5))
    spec = {"source": "local", "local": {"glob": str(tmp_path / "c.jsonl")}, "val_tokens": 600,
            "shard_tokens": 500, "vocab": "compact", "seed": 3}
    ref = prepare(spec, tmp_path / "ref", progress=False)
    real = shards._Shuffled.iter_docs

    def flaky(self, skip=0):
        for i, t in enumerate(real(self, skip)):
            if i == 50:
                raise KeyboardInterrupt
            yield t

    monkeypatch.setattr(shards._Shuffled, "iter_docs", flaky)
    monkeypatch.setattr(shards, "CHUNK_DOCS", 8)
    with pytest.raises(KeyboardInterrupt):
        prepare(spec, tmp_path / "res", progress=False)
    assert json.loads((tmp_path / ".res.partial" / "progress.json").read_text())["docs_consumed"] > 0
    monkeypatch.setattr(shards._Shuffled, "iter_docs", real)
    res = prepare({**spec, "num_threads": 1}, tmp_path / "res", progress=False)  # execution setting only
    assert (tmp_path / "res" / "manifest.json").read_bytes() == (tmp_path / "ref" / "manifest.json").read_bytes()
    assert res["_sha256"] == ref["_sha256"]
    # another seed is another permutation: other splits, same documents
    other = prepare({**spec, "seed": 4}, tmp_path / "other", progress=False)
    assert other["_sha256"] != ref["_sha256"]
    assert sorted(split_docs(other, "val") + split_docs(other, "train")) == sorted(
        split_docs(ref, "val") + split_docs(ref, "train"))
    assert split_docs(other, "val") != split_docs(ref, "val")


def test_hf_shuffle_refused():
    with pytest.raises(SpecError, match="spec.shuffle"):
        validate_spec({"source": "hf", "shuffle": True})
    assert validate_spec({"source": "hf"})["shuffle"] == "auto"


def test_hf_max_tokens_and_missing_column(tmp_path):
    docs, files = _standin(tmp_path)
    spec = {"source": "hf", "hf": {"dataset": "parquet", "data_files": {"en": files}, "split": "en",
                                   "column": "content", "max_tokens": 2500}, "val_tokens": 500, "shard_tokens": 700}
    m = prepare(spec, tmp_path / "o", progress=False)
    assert 2500 <= m["counts"]["tokens"] < 2500 + 300
    spec["hf"]["column"] = "text"
    with pytest.raises(ValueError, match="column .text. not in the rows"):
        prepare(spec, tmp_path / "o2", progress=False)


# -- shards, splits, compaction ---------------------------------------------------------------


def test_val_train_disjoint_whole_documents(corpus):
    m = corpus["full"]
    val, train = split_docs(m, "val"), split_docs(m, "train")
    docs = corpus["docs"]
    perm = np.random.default_rng(0).permutation(len(docs))  # the spec's seed (0)
    nonempty = [docs[i] for i in perm if docs[i].strip()]
    assert val + train == nonempty  # permuted order, whole documents, nothing lost
    assert not set(val) & set(train)
    vt = m["splits"]["val"]["tokens"]
    assert vt >= 1500 and vt - (len(get_encoding().encode_ordinary(val[-1])) + 1) < 1500
    assert m["val_split"]["val_tokens_requested"] == 1500
    assert m["counts"]["empty_skipped"] == 6 and m["counts"]["documents"] == 234
    assert m["counts"]["tokens"] == m["splits"]["val"]["tokens"] + m["splits"]["train"]["tokens"]
    for sp in m["splits"].values():
        for rec in sp["shards"]:
            assert rec["sha256"] and rec["documents"] == len(np.load(corpus["dir"] / "full" / rec["index"]))
    assert len(m["splits"]["train"]["shards"]) >= 2
    assert m["tokenizer"]["sha256"] == EXPECTED_SHA256
    build = json.loads((corpus["dir"] / "full" / "build.json").read_text())
    assert build["provenance"]["config_sha256"] and build["timing"]["seconds"] >= 0
    assert "provenance" not in m and "timing" not in m  # the manifest holds what determines the tokens
    # per origin: both files, every document and token counted once, in both splits
    by = {g["name"]: g for g in m["sources"]}
    assert set(by) == {"a.jsonl", "b.jsonl"}
    assert sum(g["documents"] for g in by.values()) == 234
    for split in ("val", "train"):
        assert sum(g[split]["tokens"] for g in by.values()) == m["splits"][split]["tokens"]
        assert sum(g[split]["documents"] for g in by.values()) == m["splits"][split]["documents"]
    assert all(g[split]["documents"] > 0 for g in by.values() for split in ("val", "train"))  # shuffled
    assert all(g["unk_fraction"] == 0 for g in by.values())  # full vocabulary: no UNK


def test_compaction_round_trip(corpus):
    full, comp = corpus["full"], corpus["compact"]
    ids = np.load(corpus["dir"] / "compact" / "vocab.npy")
    assert comp["vocab_size"] == ids.size + 1 and comp["unk_id"] == ids.size
    assert np.all(np.diff(ids) > 0) and EOT in ids and comp["eot_id"] == int(np.searchsorted(ids, EOT))
    assert full["vocab_size"] == N_VOCAB and full["eot_id"] == EOT
    tk = load_tokenizer(comp)
    assert tk.vocab_size == comp["vocab_size"]
    for split in ("val", "train"):
        for rf, rc in zip(full["splits"][split]["shards"], comp["splits"][split]["shards"]):
            a = np.fromfile(corpus["dir"] / "full" / rf["file"], dtype="<u4")
            b = np.fromfile(corpus["dir"] / "compact" / rc["file"], dtype="<u4")
            assert b.max() < comp["vocab_size"]
            assert np.array_equal(ids[b], a)  # compact ids map back to the originals
    assert split_docs(comp, "train") == split_docs(full, "train")
    text = corpus["docs"][0]
    assert tk.decode(tk.encode(text)) == text
    assert tk.encode(text, eot=True)[-1] == comp["eot_id"]
    unseen = "Quixotic xylophones"
    enc = tk.encode(unseen)
    assert comp["unk_id"] in enc and "\ufffd" in tk.decode(enc)
    assert load_tokenizer(full).encode("hello world") == [15339, 1917]


# -- bad input ---------------------------------------------------------------------------------


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_shard(corpus, tmp_path):
    d = _copy(corpus["dir"] / "full", tmp_path / "t")
    f = d / corpus["full"]["splits"]["train"]["shards"][0]["file"]
    data = f.read_bytes()
    f.write_bytes(data[:-2])
    with pytest.raises(ManifestError, match=f"{f.name}.*multiple of 4"):
        load_manifest(d)
    f.write_bytes(data[:-4])
    with pytest.raises(ManifestError, match=f"{f.name}.*truncated"):
        load_manifest(d, verify="size")


def test_altered_shard(corpus, tmp_path):
    d = _copy(corpus["dir"] / "full", tmp_path / "t")
    f = d / corpus["full"]["splits"]["val"]["shards"][0]["file"]
    a = np.fromfile(f, dtype="<u4")
    a[5] ^= 1
    a.tofile(f)
    with pytest.raises(ManifestError, match=f"{f.name}.*sha256"):
        load_manifest(d)
    load_manifest(d, verify="size")  # sizes only: huge data can skip hashing


def test_wrong_tokenizer_manifest(corpus, tmp_path):
    d = _copy(corpus["dir"] / "full", tmp_path / "t")
    m = json.loads((d / "manifest.json").read_text())
    m["tokenizer"]["name"] = "o200k_base"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="manifest.json.*tokenizer.*o200k_base"):
        load_manifest(d)


def test_missing_shard_and_bad_json(corpus, tmp_path):
    d = _copy(corpus["dir"] / "full", tmp_path / "t")
    f = d / corpus["full"]["splits"]["train"]["shards"][-1]["file"]
    f.unlink()
    with pytest.raises(ManifestError, match=f"{f.name}.*missing"):
        load_manifest(d)
    (d / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="manifest.json"):
        load_manifest(d)


def test_empty_corpus(tmp_path):
    write_jsonl(tmp_path / "e.jsonl", ["", "  ", "\n"])
    with pytest.raises(ValueError, match="empty corpus"):
        prepare({"source": "local", "local": {"glob": str(tmp_path / "e.jsonl")}}, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()
    with pytest.raises(FileNotFoundError, match="matches no files"):
        prepare({"source": "local", "local": {"glob": str(tmp_path / "nothing*.txt")}}, tmp_path / "o", progress=False)
    write_jsonl(tmp_path / "s.jsonl", ["just one short document"])
    with pytest.raises(ValueError, match="val_tokens"):
        prepare({"source": "local", "local": {"glob": str(tmp_path / "s.jsonl")}, "val_tokens": 100},
                tmp_path / "o", progress=False)


def test_spec_validation():
    assert validate_spec({})["source"] == "embedded"
    for bad, key in [({"sorce": "hf"}, "spec.sorce"), ({"source": "web"}, "spec.source"),
                     ({"embedded": {"max_docs": 3}}, "spec.embedded.max_docs"),
                     ({"vocab": "tiny"}, "spec.vocab"), ({"val_tokens": -1}, "spec.val_tokens"),
                     ({"hf": {"max_tokens": "10"}}, "spec.hf.max_tokens"),
                     ({"source": "local"}, "spec.local.glob")]:
        with pytest.raises(SpecError, match=key.replace(".", r"\.")):
            validate_spec(bad)


def test_cli(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", make_docs(20, seed=5))
    spec = {"source": "local", "local": {"glob": str(tmp_path / "c.jsonl")}, "val_tokens": 100,
            "shard_tokens": 500, "vocab": "compact", "seed": 0}
    assert cli.main(["--spec", json.dumps(spec), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    m = load_manifest(tmp_path / "out" / "manifest.json")
    assert m["vocab"] == "compact" and m["stage"] == "data"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert cli.main(["--spec", '{"vocab_size": 3}', "--out", str(tmp_path / "o2")]) == 2
    assert "spec.vocab_size" in capsys.readouterr().err
    bad = {"source": "local", "local": {"glob": str(tmp_path / "none*.jsonl")}}
    assert cli.main(["--spec", json.dumps(bad), "--out", str(tmp_path / "o3"), "--no-progress"]) == 2  # bad input: exit 2
    assert "matches no files" in capsys.readouterr().err


# ---- the paper's data without the network: a pre-staged copy, or a one-line refusal


def _staged_copy(root, docs):
    """A pre-staged copy laid out like the Hub repository: README.md with the split definitions, the
    split's parquet files under data/ultrafineweb_en/."""
    (root / "data" / "ultrafineweb_en").mkdir(parents=True)
    (root / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: en\n"
                                    "    path: data/ultrafineweb_en/*\n---\n# a stand-in\n")
    n = len(docs)
    for k in range(3):
        write_parquet(root / "data" / "ultrafineweb_en" / f"part-{k:04d}.parquet", docs[k * n // 3:(k + 1) * n // 3],
                      "content")
    return root


HUB = {"dataset": "openbmb/Ultra-FineWeb", "split": "en", "column": "content"}


def test_hub_dataset_without_network_or_copy_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = {"source": "hf", "hf": dict(HUB), "val_tokens": 800, "shard_tokens": 700}
    assert cli.main(["--spec", json.dumps(spec), "--out", str(tmp_path / "d"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "cannot reach (HF_HUB_OFFLINE is set)" in err and "data.hf.local_dir" in err and "docs/slurm.md" in err
    assert not (tmp_path / "d").exists()
    # no offline switch, but no route to the Hub either
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)

    def no_route(*a, **k):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr("socket.create_connection", no_route)
    assert sources.hub_unreachable() == "huggingface.co:443: Network is unreachable"
    with pytest.raises(sources.StagingError, match=r"cannot reach \(huggingface.co:443: Network is unreachable\)"):
        sources.HFSource(**HUB).open()


def test_a_missing_copy_is_named(tmp_path):
    with pytest.raises(sources.StagingError, match=rf"data.hf.local_dir: {tmp_path / 'gone'}: no such folder"):
        sources.HFSource(**HUB, local_dir=str(tmp_path / "gone")).open()


def test_a_pre_staged_copy_is_read_offline_as_the_hub_would_stream_it(tmp_path, monkeypatch):
    docs = make_docs(90, seed=11)
    staged = _staged_copy(tmp_path / "Ultra-FineWeb", docs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec = {"source": "hf", "hf": dict(HUB, local_dir=str(staged)), "val_tokens": 800, "shard_tokens": 700}
    m = prepare(spec, tmp_path / "d", progress=False)
    assert split_docs(m, "val") + split_docs(m, "train") == [d for d in docs if d.strip()]
    assert "local_dir" not in json.dumps(m["spec"])  # where the copy lies is not what the data are
    # the same files streamed as named files give the same shards: the copy is read in the Hub's order
    files = sorted(str(p) for p in (staged / "data" / "ultrafineweb_en").iterdir())
    ref = prepare({"source": "hf", "hf": {"dataset": "parquet", "data_files": {"en": files}, "split": "en",
                                          "column": "content"}, "val_tokens": 800, "shard_tokens": 700},
                  tmp_path / "ref", progress=False)
    for split in ("val", "train"):
        assert [s["sha256"] for s in m["splits"][split]["shards"]] == [s["sha256"] for s in ref["splits"][split]["shards"]]


PIN = "02c85641e3d19a854be2e09139c25adaa9518063"


def _record_download(root, commit):
    """What `huggingface-cli download --local-dir` leaves beside each file: its commit on line 1."""
    meta = root / ".cache" / "huggingface" / "download" / "data" / "ultrafineweb_en"
    meta.mkdir(parents=True)
    for f in (root / "data" / "ultrafineweb_en").iterdir():
        (meta / f"{f.name}.metadata").write_text(f"{commit}\n\"etag\"\n1764000000.0\n")


def test_the_manifest_records_the_commit_a_copy_was_downloaded_from(tmp_path, monkeypatch):
    """A pinned revision and a copy of that commit: read offline, the commit in the manifest; a copy of
    another commit is refused in one line before anything is read."""
    docs = make_docs(60, seed=12)
    staged = _staged_copy(tmp_path / "Ultra-FineWeb", docs)
    _record_download(staged, PIN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec = {"source": "hf", "hf": dict(HUB, revision=PIN, local_dir=str(staged)), "val_tokens": 800,
            "shard_tokens": 700}
    m = prepare(spec, tmp_path / "d", progress=False)
    assert m["source"]["revision"] == m["source"]["resolved_revision"] == PIN
    assert m["source"]["revision_source"] == "the copy's download records"
    other = "1" * 40
    spec["hf"]["revision"] = other
    with pytest.raises(sources.StagingError, match=rf"was downloaded from commit\(s\) {PIN[:12]} of openbmb/Ultra-FineWeb, "
                                                   rf"not data.hf.revision {other[:12]}; .* --revision {other}"):
        prepare(spec, tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


def test_a_hub_stream_reads_and_records_one_commit(tmp_path, monkeypatch):
    """Pinned: the stream opens at that commit. At a branch: the branch is resolved to its commit when
    the stream opens, the stream reads that commit and the manifest records it; where the Hub cannot
    say, the stage refuses, naming the key."""
    docs, files = _standin(tmp_path, n=60)
    opened = []

    def fake_load(where, **kw):  # the Hub stream, stood in for by the local parquet files
        opened.append(kw.get("revision"))
        import datasets

        return datasets.load_dataset("parquet", data_files={"en": files}, split="en", streaming=True)

    monkeypatch.setattr(sources.HFSource, "load_dataset", staticmethod(fake_load))
    monkeypatch.setattr(sources, "_hub_commit", lambda dataset, revision: "a" * 40)
    for revision, want in ((PIN, PIN), (None, "a" * 40), ("main", "a" * 40)):
        spec = {"source": "hf", "hf": dict(HUB, revision=revision), "val_tokens": 800, "shard_tokens": 700}
        m = prepare(spec, tmp_path / f"d-{revision}", progress=False)
        assert opened[-1] == want and m["source"]["resolved_revision"] == want, revision
    assert "pin it" in m["source"]["revision_source"]
    assert sources.HFSource(**HUB).fingerprint() == "a" * 40  # a half-built corpus never changes commit
    assert sources.HFSource(**HUB, revision=PIN).fingerprint() is None  # the spec says it

    def unreachable(dataset, revision):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(sources, "_hub_commit", unreachable)
    with pytest.raises(sources.StagingError, match=r"data.hf.revision: cannot resolve 'main' of openbmb/Ultra-FineWeb "
                                                   r"to a commit \(OSError: Network is unreachable\); .* pinned commit"):
        sources.HFSource(**HUB).open()
