"""The offline documentation corpus (lrattnres.data.docs) and the data stage's pack source."""

from __future__ import annotations

import gzip
import json
import lzma

import numpy as np
import pytest

from lrattnres.data import docs, prepare, validate_spec
from lrattnres.data.docs import Collection, PackError

PROSE = ("Routing reads every earlier output of the network and mixes them with learned weights; "
         "the low-rank variant scores each source on a few coordinates only. ") * 12

HTML = f"""<html><head><title>T</title><style>p {{color: red}}</style><script>var x = 1;</script></head>
<body><div class="navheader">Prev Next Home</div><nav>Sidebar link</nav>
<div class="body" role="main"><h1>Depth routing</h1><p>{PROSE}</p><ul><li>First &amp; second</li>
<li>Third<br>line</li></ul><a class="headerlink" href="#x">¶</a></div>
<div class="navfooter">Footer nav</div></body></html>"""

POD = f"""=head1 NAME

perlroute - B<depth> routing in I<Perl>

=head1 DESCRIPTION

{PROSE} See L<perlfunc/sort> and C<E<lt>E<gt>>.

=begin html

<p>skipped</p>

=end html

=cut
"""


@pytest.fixture()
def roots(tmp_path):
    (tmp_path / "h" / "sub").mkdir(parents=True)
    (tmp_path / "h" / "page.html").write_text(HTML, encoding="utf-8")
    (tmp_path / "h" / "sub" / "page2.html").write_text(HTML.replace("Depth routing", "Second page"), encoding="utf-8")
    (tmp_path / "h" / "genindex.html").write_text(HTML.replace("Depth", "Index"), encoding="utf-8")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "perlroute.pod").write_text(POD, encoding="utf-8")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.rst.gz").write_bytes(gzip.compress(("Title\n=====\n\n" + PROSE).encode()))
    (tmp_path / "t" / "short.txt.gz").write_bytes(gzip.compress(b"too short"))
    (tmp_path / "t" / "dup.rst.gz").write_bytes(gzip.compress(("Title\n=====\n\n" + PROSE).encode()))
    cols = [
        Collection("web", "no-such-package-a", str(tmp_path / "h"), ("**/*.html",), "html", "test",
                   exclude=("genindex.html",)),
        Collection("pod", "no-such-package-b", str(tmp_path / "p"), ("*.pod",), "pod", "test"),
        Collection("text", "no-such-package-c", str(tmp_path / "t"), ("*.gz",), "text", "test"),
    ]
    return tmp_path, cols


def test_html_text_drops_chrome():
    text = docs.normalise(docs.html_text(HTML))
    assert text.startswith("Depth routing") and "Routing reads every earlier output" in text
    for chrome in ("Prev Next Home", "Sidebar link", "Footer nav", "var x", "color: red", "¶"):
        assert chrome not in text, chrome
    assert "First & second" in text and "Third\nline" in text


def test_pod_text():
    text = docs.pod_text(POD)
    assert "perlroute - depth routing in Perl" in text
    assert "See perlfunc/sort and <>." in text
    assert "skipped" not in text and "=head1" not in text and "B<" not in text


def test_pack_round_trip_is_deterministic(roots):
    tmp, cols = roots
    h1 = docs.build_pack(tmp / "one.jsonl.xz", cols, min_chars=200)
    h2 = docs.build_pack(tmp / "two.jsonl.xz", cols, min_chars=200)
    assert (tmp / "one.jsonl.xz").read_bytes() == (tmp / "two.jsonl.xz").read_bytes()  # no timestamps
    assert h1 == h2 == docs.read_header(tmp / "one.jsonl.xz")
    by = {c["name"]: c for c in h1["collections"]}
    assert by["web"]["documents"] == 2 and by["web"]["duplicates_skipped"] == 0  # index excluded
    # page2 differs only in its heading; dup.rst.gz is an exact duplicate of a.rst.gz
    assert by["text"]["documents"] == 1 and by["text"]["duplicates_skipped"] == 1
    got = list(docs.iter_pack(tmp / "one.jsonl.xz"))
    assert [(s, i) for s, i, _ in got] == [("web", "page.html"), ("web", "sub/page2.html"),
                                          ("pod", "perlroute.pod"), ("text", "a.rst.gz")][: len(got)]


def test_missing_and_corrupt_packs(roots, tmp_path):
    _, cols = roots
    absent = Collection("absent", "pkg-not-installed", str(tmp_path / "nowhere"), ("*",), "text", "t")
    with pytest.raises(PackError, match="apt-get install pkg-not-installed"):
        docs.build_pack(tmp_path / "x.jsonl.xz", cols + [absent])
    h = docs.build_pack(tmp_path / "x.jsonl.xz", cols + [absent], require_all=False)
    assert h["missing"] == ["absent"]
    with pytest.raises(PackError, match="pack not found"):
        docs.read_header(tmp_path / "nope.jsonl.xz")
    (tmp_path / "junk.jsonl.xz").write_bytes(b"\x00not xz at all")
    with pytest.raises(PackError, match="not an xz-compressed pack"):
        docs.read_header(tmp_path / "junk.jsonl.xz")
    raw = (tmp_path / "x.jsonl.xz").read_bytes()
    (tmp_path / "cut.jsonl.xz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(PackError, match="truncated or corrupt"):
        list(docs.iter_pack(tmp_path / "cut.jsonl.xz"))
    with lzma.open(tmp_path / "nohead.jsonl.xz", "wt") as f:
        f.write(json.dumps({"source": "a", "id": "b", "text": "c"}) + "\n")
    with pytest.raises(PackError, match="not a pack header"):
        docs.read_header(tmp_path / "nohead.jsonl.xz")


def test_unknown_collection_named():
    with pytest.raises(ValueError, match="unknown collection"):
        docs.by_name(["linux", "nonsense"])


def test_prepare_from_pack_counts_per_collection(roots):
    tmp, cols = roots
    docs.build_pack(tmp / "c.jsonl.xz", cols, min_chars=200)
    spec = {"source": "pack", "pack": {"path": str(tmp / "c.jsonl.xz"), "min_chars": 200},
            "val_tokens": 50, "shard_tokens": 10_000, "vocab": "compact", "vocab_max": 20}
    m = prepare(spec, tmp / "data", progress=False)
    assert m["source"]["kind"] == "pack" and len(m["source"]["sha256"]) == 64
    by = {g["name"]: g for g in m["sources"]}
    assert set(by) == {"web", "pod", "text"}
    assert sum(g["tokens"] for g in by.values()) == m["counts"]["tokens"]
    # a vocabulary of 20 ids leaves tokens UNK in every collection
    assert all(0 < g["unk_fraction"] < 1 for g in by.values())
    total_unk = sum(g["unk_tokens"] for g in by.values())
    assert total_unk / m["counts"]["tokens"] == pytest.approx(m["vocab_map"]["unk_token_fraction"])
    # the shards agree: the UNK id's count in the shards is the sum over collections
    shard_unk = sum(int((np.fromfile(tmp / "data" / r["file"], "<u4") == m["unk_id"]).sum())
                    for split in m["splits"].values() for r in split["shards"])
    assert shard_unk == total_unk
    # a subset of collections, and guards: wrong min_chars, wrong sha256, unknown collection
    sub = prepare({**spec, "pack": {**spec["pack"], "collections": ["web", "pod"]}}, tmp / "sub", progress=False)
    assert sorted(g["name"] for g in sub["sources"]) == ["pod", "web"]
    with pytest.raises(PackError, match="min_chars"):
        prepare({**spec, "pack": {**spec["pack"], "min_chars": 10}}, tmp / "bad1", progress=False)
    with pytest.raises(PackError, match="sha256"):
        prepare({**spec, "pack": {**spec["pack"], "sha256": "0" * 64}}, tmp / "bad2", progress=False)
    with pytest.raises(PackError, match="no collection"):
        prepare({**spec, "pack": {**spec["pack"], "collections": ["linux"]}}, tmp / "bad3", progress=False)


def test_pack_spec_validation():
    from lrattnres.data import SpecError

    with pytest.raises(SpecError, match="spec.pack.path"):
        validate_spec({"source": "pack"})
    with pytest.raises(SpecError, match="spec.pack.sha256"):
        validate_spec({"source": "pack", "pack": {"path": "x", "sha256": "abc"}})
    with pytest.raises(SpecError, match="spec.pack.collections"):
        validate_spec({"source": "pack", "pack": {"path": "x", "collections": []}})


def _dpkg(roots_dir, versions):
    """Fake dpkg lookups: page2.html comes from a second package (as the Perl manual's perldiag.pod
    comes from perl-modules-5.36), the text files from none."""
    def owners(files):
        out = {}
        for f in map(str, files):
            if f.endswith("page2.html"):
                out[f] = ["doc-web-extra"]
            elif f.startswith(str(roots_dir / "h")):
                out[f] = ["doc-web"]
            elif f.startswith(str(roots_dir / "p")):
                out[f] = ["doc-pod"]
            else:
                out[f] = []
        return out

    return {"owners": owners, "versions": lambda pkgs: {p: versions.get(p) for p in pkgs}}


def test_pack_records_every_package_it_was_extracted_from(roots):
    tmp, cols = roots
    v1 = {"doc-web": "1.0", "doc-web-extra": "2.0", "doc-pod": "3.1"}
    h1 = docs.build_pack(tmp / "a.jsonl.xz", cols, min_chars=200, **_dpkg(tmp, v1))
    by = {c["name"]: c for c in h1["collections"]}
    assert by["web"]["packages"] == {"doc-web": "1.0", "doc-web-extra": "2.0"} and by["web"]["unowned_files"] == 0
    assert by["text"]["packages"] == {} and by["text"]["unowned_files"] == 3
    assert h1["packages"] == {"doc-pod": "3.1", "doc-web": "1.0", "doc-web-extra": "2.0"}
    assert docs.read_header(tmp / "a.jsonl.xz")["packages"] == h1["packages"]
    # the same texts from another version of one package: another pack, and one line says which
    h2 = docs.build_pack(tmp / "b.jsonl.xz", cols, min_chars=200, **_dpkg(tmp, {**v1, "doc-web-extra": "2.1"}))
    assert (tmp / "a.jsonl.xz").read_bytes() != (tmp / "b.jsonl.xz").read_bytes()
    line = docs.diff_line(docs.header_packages(h1), docs.header_packages(h2), "a.jsonl.xz")
    assert line == "1 of 3 packages differ from a.jsonl.xz: doc-web-extra 2.0 -> 2.1"
    assert "\n" not in line
    assert docs.diff_line(h1["packages"], h1["packages"], "a.jsonl.xz") == "the same 3 package versions as a.jsonl.xz"
    assert docs.version_diff({"x": "1"}, {"y": "2"}) == [("x", "1", None), ("y", None, "2")]
    # a pack made before the record names its collections' own packages only
    old = {"collections": [{"package": "doc-web", "version": "1.0"}, {"package": "doc-pod", "version": "3.1"}]}
    assert docs.diff_line(docs.header_packages(old), h1["packages"], "old") == \
        "1 of 3 packages differ from old: doc-web-extra absent -> 2.0"
    # the data stage's manifest carries the versions
    spec = {"source": "pack", "pack": {"path": str(tmp / "a.jsonl.xz"), "min_chars": 200},
            "val_tokens": 50, "shard_tokens": 10_000, "vocab": "compact", "vocab_max": 200}
    m = prepare(spec, tmp / "data", progress=False)
    assert m["source"]["packages"] == h1["packages"]
    sub = prepare({**spec, "pack": {**spec["pack"], "collections": ["web"]}}, tmp / "sub", progress=False)
    assert sub["source"]["packages"] == {"doc-web": "1.0", "doc-web-extra": "2.0"}


def test_corpus_pack_compares_in_one_line(roots, monkeypatch, capsys):
    tmp, cols = roots
    fake = _dpkg(tmp, {"doc-web": "1.0", "doc-web-extra": "2.0", "doc-pod": "3.1"})
    docs.build_pack(tmp / "ref.jsonl.xz", cols, min_chars=200, **fake)
    monkeypatch.setattr(docs, "COLLECTIONS", tuple(cols))
    monkeypatch.setattr(docs, "file_owners", fake["owners"])
    monkeypatch.setattr(docs, "package_versions", lambda pkgs: {p: {"doc-web": "1.1"}.get(p, "2.0" if p == "doc-web-extra" else "3.1") for p in pkgs})
    assert docs.main(["--compare", str(tmp / "ref.jsonl.xz")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"corpus-pack: installed: 1 of 3 packages differ from {tmp / 'ref.jsonl.xz'}: doc-web 1.0 -> 1.1"]
    assert docs.main(["--out", str(tmp / "new.jsonl.xz"), "--min-chars", "200", "--compare", str(tmp / "ref.jsonl.xz")]) == 0
    assert capsys.readouterr().out.strip().endswith("doc-web 1.0 -> 1.1")
