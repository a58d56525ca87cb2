"""An offline corpus of natural-language text: the documentation that Debian packages install.

The small scales read docstrings (:class:`lrattnres.data.sources.EmbeddedSource`); a one-GPU scale
needs tens of millions of tokens of prose, which no package registry carries as data. Debian's
documentation packages do: the Linux kernel's documentation, Python's and PostgreSQL's manuals, the
Perl documentation, the scikit-learn, pandas and Django guides, the GIMP and LibreOffice help, the
Debian handbooks. :data:`COLLECTIONS` names each one (package, files, reader, why it is in).

``python -m lrattnres corpus-pack --out P.jsonl.xz`` extracts the text of the installed collections
into one xz-compressed JSON-lines *pack*: a header line, then one ``{"source", "id", "text"}`` line
per document, in a fixed order (collections as listed, files by sorted path). The pack holds no
timestamps: the same package versions give the same bytes, so a pack built on one machine can be
carried to another (a GPU machine without a package registry) and named by its sha256. The data
stage reads a pack as ``source: pack``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import lzma
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

from lrattnres.io import atomic_path

PACK_FORMAT = "lrattnres-docpack/1"


@dataclass(frozen=True)
class Collection:
    """One documentation package: where its files are and how to read them."""

    name: str
    package: str  # the Debian package that installs it
    root: str
    include: tuple[str, ...]  # glob patterns, relative to root
    reader: str  # text | html | pod
    why: str
    exclude: tuple[str, ...] = field(default=())


# Prose-heavy manuals first. Where a Sphinx build ships its reStructuredText sources
# (``_sources/*.txt``), they are read instead of the HTML: the same text without navigation.
COLLECTIONS: tuple[Collection, ...] = (
    Collection("linux", "linux-doc-6.1", "/usr/share/doc/linux-doc-6.1/Documentation",
               ("**/*.rst.gz", "**/*.txt.gz"), "text",
               "the kernel's documentation: guides, subsystem and driver manuals",
               exclude=("devicetree/bindings/**", "ABI/**", "translations/**", "output/**")),
    Collection("python", "python3.11-doc", "/usr/share/doc/python3.11/html/_sources",
               ("**/*.txt",), "text", "Python's tutorial, library reference, HOWTOs and FAQs",
               exclude=("whatsnew/changelog.rst.txt",)),
    Collection("postgresql", "postgresql-doc-15", "/usr/share/doc/postgresql-doc-15/html",
               ("*.html",), "html", "the PostgreSQL manual", exclude=("bookindex.html",)),
    Collection("perl", "perl-doc", "/usr/share/perl/5.36/pod", ("*.pod",), "pod",
               "Perl's manual pages, tutorials and FAQs", exclude=("perl5*delta.pod",)),
    Collection("sklearn", "python-sklearn-doc", "/usr/share/doc/python-sklearn-doc/html/_sources",
               ("**/*.txt",), "text", "scikit-learn's user guide and examples",
               exclude=("modules/generated/**",)),
    Collection("pandas", "python-pandas-doc", "/usr/share/doc/python-pandas-doc/html/_sources",
               ("**/*.txt",), "text", "the pandas user guide", exclude=("reference/api/**", "whatsnew/**")),
    Collection("django", "python-django-doc", "/usr/share/doc/python-django-doc/html",
               ("**/*.html",), "html", "Django's tutorials, topic guides and reference",
               exclude=("genindex*.html", "py-modindex.html", "search.html", "_modules/**", "releases/**")),
    Collection("gimp", "gimp-help-en", "/usr/share/gimp/2.0/help/en", ("*.html",), "html",
               "the GIMP user manual"),
    Collection("libreoffice", "libreoffice-help-en-us", "/usr/share/libreoffice/help/en-US",
               ("text/**/*.html",), "html", "LibreOffice's help pages"),
    Collection("git", "git-doc", "/usr/share/doc/git-doc", ("*.txt", "howto/*.txt", "technical/*.txt"),
               "text", "git's manual pages, user manual and guides", exclude=("RelNotes/**",)),
    Collection("debian-handbook", "debian-handbook", "/usr/share/doc/debian-handbook/html/en-US",
               ("*.html",), "html", "The Debian Administrator's Handbook"),
    Collection("debian-policy", "debian-policy", "/usr/share/doc/debian-policy/policy.html",
               ("*.html",), "html", "the Debian Policy Manual", exclude=("genindex.html", "search.html")),
    Collection("developers-reference", "developers-reference",
               "/usr/share/developers-reference", ("*.html",), "html", "the Debian developer's reference",
               exclude=("genindex.html", "search.html")),
    Collection("maint-guide", "maint-guide", "/usr/share/doc/maint-guide/html", ("*.en.html",), "html",
               "the Debian New Maintainers' Guide"),
    Collection("sqlite", "sqlite3-doc", "/usr/share/doc/sqlite3", ("*.html", "c3ref/*.html"), "html",
               "SQLite's documentation: the SQL dialect, design notes and the C interface"),
    Collection("apache", "apache2-doc", "/usr/share/doc/apache2-doc/manual/en", ("**/*.html",), "html",
               "the Apache HTTP Server manual"),
    Collection("cmake", "cmake-doc", "/usr/share/doc/cmake-data/html/_sources", ("**/*.txt",), "text",
               "CMake's guides and reference"),
    Collection("vim", "vim-runtime", "/usr/share/vim/vim90/doc", ("*.txt",), "text",
               "Vim's user manual and reference"),
    Collection("octave", "octave-doc", "/usr/share/doc/octave/octave.html", ("*.html",), "html",
               "the GNU Octave manual"),
    Collection("maxima", "maxima-doc", "/usr/share/doc/maxima-doc/html", ("*.html",), "html",
               "the Maxima manual"),
    Collection("ffmpeg", "ffmpeg-doc", "/usr/share/doc/ffmpeg/manual", ("*.html",), "html",
               "FFmpeg's manuals", exclude=("ffmpeg-all.html", "ffprobe-all.html", "ffplay-all.html")),
    Collection("gnucash", "gnucash-docs", "/usr/share/doc/gnucash-docs",
               ("gnucash-guide-en/*.html", "gnucash-help-en/*.html"), "html", "the GnuCash guide and help"),
    Collection("kicad", "kicad-doc-en", "/usr/share/doc/kicad/help/en", ("*.html",), "html",
               "the KiCad manuals"),
    Collection("rust", "rust-doc", "/usr/share/doc/rust-doc/html",
               tuple(f"{b}/**/*.html" for b in ("book", "reference", "nomicon", "rust-by-example",
                                               "edition-guide", "embedded-book", "rustc")),
               "html", "The Rust Programming Language, the Rust reference, the Rustonomicon and other books",
               exclude=("**/print.html", "**/toc.html", "**/404.html", "**/searchindex*")),
    Collection("java", "openjdk-17-doc", "/usr/share/doc/openjdk-17-jre-headless/api", ("**/*.html",),
               "html", "the Java SE 17 API specification",
               exclude=("index-files/**", "**/class-use/**", "**/package-tree.html", "**/package-use.html",
                        "overview-tree.html", "allclasses*.html", "allpackages*.html", "deprecated-list.html",
                        "**/module-summary.html", "help-doc.html", "serialized-form.html", "constant-values.html",
                        "search.html", "index.html", "legal/**")),
)

DEFAULT_MIN_CHARS = 500


class PackError(ValueError):
    """A pack that is missing, truncated or not a pack; the message names the file."""


# ------------------------------------------------------------------------------------- readers


class _TextOfHTML(HTMLParser):
    """The visible text of an HTML page, without scripts, styles, navigation and page chrome."""

    SKIP_TAGS = {"script", "style", "head", "nav", "header", "footer", "noscript", "svg", "button", "form"}
    SKIP_CLASSES = {"navheader", "navfooter", "sphinxsidebar", "related", "footer", "headerlink",
                    "toc", "breadcrumbs", "navigation", "skip-link", "sidebar", "nav", "docnav",
                    "bottom-nav", "side-nav", "contents", "menu-bar", "nav-wrapper", "nav-chapters",
                    "menu", "nosearch"}
    BLOCK = {"p", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table", "dt", "dd",
             "blockquote", "section", "article", "br", "hr", "ul", "ol", "dl", "title", "td", "th"}
    VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source",
            "track", "wbr", "param"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # open tags and whether each starts a skipped region
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            if tag in ("br", "hr") and not self.skipping:
                self.parts.append("\n")
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skip = (tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES)
                or a.get("role") in ("navigation", "search") or a.get("aria-hidden") == "true")
        self.stack.append((tag, skip))
        if skip:
            self.skipping += 1
        if tag in self.BLOCK and not self.skipping:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        # close up to the matching open tag (tolerates unclosed <p>, <li> ...)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                for _, skip in self.stack[i:]:
                    if skip:
                        self.skipping -= 1
                del self.stack[i:]
                break
        if tag in self.BLOCK and not self.skipping:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def html_text(markup: str) -> str:
    p = _TextOfHTML()
    p.feed(markup)
    p.close()
    return "".join(p.parts)


_POD_CODE = re.compile(r"[BICFSLXEZ]<<+\s(.*?)\s>>+|[BICFSLXEZ]<([^<>]*)>")
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_inline(text: str) -> str:
    # escapes become private-use placeholders until every code is gone, so E<lt> cannot open a code
    marks = {"<": "\ue000", ">": "\ue001"}

    def one(m):
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        code = m.group(0)[0]
        if code == "E":
            ch = _POD_ESCAPES.get(inner, html.unescape(f"&{inner};"))
            return marks.get(ch, ch)
        if code in "XZ":
            return ""
        if code == "L":
            return inner.split("|", 1)[0]
        return inner

    for _ in range(6):  # nested codes: B<I<x>>
        new = _POD_CODE.sub(one, text)
        if new == text:
            break
        text = new
    return text.replace(marks["<"], "<").replace(marks[">"], ">")


def pod_text(pod: str) -> str:
    """Plain text of a POD document: headings and items kept, directives and formatting codes dropped."""
    out: list[str] = []
    skipping = False
    for para in re.split(r"\n\s*\n", pod):
        if para.startswith("="):
            cmd, _, rest = para[1:].partition(" ")
            cmd = cmd.strip()
            if cmd in ("begin", "for"):
                skipping = cmd == "begin"
                continue
            if cmd == "end":
                skipping = False
                continue
            if cmd.startswith("head") or cmd == "item":
                out.append(_pod_inline(rest.strip()))
            continue  # =pod, =cut, =over, =back, =encoding
        if not skipping:
            out.append(_pod_inline(para))
    return "\n\n".join(out)


def read_file(path: Path, reader: str) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8", errors="replace")
    if reader == "html":
        text = html_text(text)
    elif reader == "pod":
        text = pod_text(text)
    return normalise(text)


_SPACES = re.compile(r"[ \t\r\f\v\u00a0]+")
_BLANKS = re.compile(r"\n{3,}")


def normalise(text: str) -> str:
    """Runs of spaces to one space, trailing spaces dropped, at most one blank line in a row."""
    lines = [_SPACES.sub(" ", ln).rstrip() for ln in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


# --------------------------------------------------------------------------------- collections


def collection_files(c: Collection, root: str | None = None) -> list[Path]:
    """The files of a collection, by sorted path relative to its root."""
    base = Path(root or c.root)
    if not base.is_dir():
        return []
    found = set()
    for pattern in c.include:
        found.update(p for p in base.glob(pattern) if p.is_file())
    rels = sorted(p.relative_to(base).as_posix() for p in found)
    return [base / r for r in rels if not any(fnmatch(r, x) for x in c.exclude)]


def package_version(package: str) -> str | None:
    """The installed version of a Debian package, or None (not installed, or no dpkg)."""
    return package_versions([package]).get(package)


def package_versions(packages) -> dict[str, str | None]:
    """Installed version of each Debian package (``dpkg-query -W``); None where it is not installed or
    there is no dpkg."""
    names = sorted(set(packages))
    out: dict[str, str | None] = dict.fromkeys(names)
    if not names:
        return out
    try:
        run = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Version}\n", *names], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return out
    for line in run.stdout.splitlines():
        name, _, version = line.partition("\t")
        name = name.split(":")[0]  # an architecture-qualified name (pkg:amd64)
        if name in out and version.strip():
            out[name] = version.strip()
    return out


_DPKG_CHUNK = 2000  # paths per dpkg-query call (the argument list stays short)


def file_owners(paths) -> dict[str, list[str]]:
    """The Debian packages that installed each file (``dpkg-query -S``), by path as given; ``[]`` where
    no package owns it (or there is no dpkg). A path is looked up as its real path (a symlinked folder,
    e.g. /usr/share/perl/5.36 -> 5.36.0, is how dpkg does not know it), then as given."""
    paths = [str(p) for p in paths]
    real = {p: os.path.realpath(p) for p in paths}
    found: dict[str, list[str]] = {}
    for query in (sorted(set(real.values())), sorted(set(paths))):
        query = [q for q in query if q not in found]
        for i in range(0, len(query), _DPKG_CHUNK):
            try:
                run = subprocess.run(["dpkg-query", "-S", *query[i:i + _DPKG_CHUNK]], capture_output=True,
                                     text=True, timeout=300)
            except (OSError, subprocess.SubprocessError):
                return {p: [] for p in paths}
            for line in run.stdout.splitlines():
                if line.startswith("diversion ") or ": " not in line:
                    continue
                pkgs, _, path = line.partition(": ")
                found.setdefault(path, sorted({x.strip().split(":")[0] for x in pkgs.split(",") if x.strip()}))
    return {p: found.get(real[p]) or found.get(p) or [] for p in paths}


def iter_collection(c: Collection, min_chars: int, root: str | None = None) -> Iterator[tuple[str, str]]:
    """``(id, text)`` of every document of ``c`` with at least ``min_chars`` characters."""
    base = Path(root or c.root)
    for path in collection_files(c, root):
        text = read_file(path, c.reader)
        if len(text) >= min_chars:
            yield path.relative_to(base).as_posix(), text


def by_name(names: list[str] | None) -> list[Collection]:
    if not names:
        return list(COLLECTIONS)
    known = {c.name: c for c in COLLECTIONS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown collection(s) {unknown}; expected some of {list(known)}")
    return [known[n] for n in names]


# ---------------------------------------------------------------------------------------- packs


def installed_packages(files: list[Path], owners=None, versions=None) -> tuple[dict, int]:
    """({package: version} of every package that installed one of ``files``, count of files no
    package owns); ``owners`` and ``versions`` default to the dpkg lookups."""
    owners, versions = owners or file_owners, versions or package_versions
    owned = owners(files)
    pkgs = sorted({p for ps in owned.values() for p in ps})
    return dict(sorted(versions(pkgs).items())), sum(1 for ps in owned.values() if not ps)


def build_pack(out: str | os.PathLike, collections: list[Collection], *, min_chars: int = DEFAULT_MIN_CHARS,
               roots: dict[str, str] | None = None, require_all: bool = True, progress=None,
               owners=None, versions=None) -> dict:
    """Write the pack of ``collections`` to ``out`` (atomically); return its header.

    Exact duplicate texts are kept once (the first in order). ``roots`` replaces collections' roots
    (for tests). With ``require_all``, a collection whose package is not installed is an error that
    names the packages to install; otherwise it is left out and the header says so.

    The header records, per collection and for the whole pack (``packages``), the version of every
    Debian package that installed a file the pack read: not only the collection's own package (the
    Perl manual's perldiag.pod, for one, is installed by perl-modules-5.36), so that two packs of
    the same versions are the same bytes and a rebuild says which versions differ
    (:func:`version_diff`). ``owners`` and ``versions`` look them up (dpkg; replaced in tests).
    """
    roots = roots or {}
    versions = versions or package_versions
    say = progress or (lambda msg: None)
    present, missing = [], []
    for c in collections:
        (present if collection_files(c, roots.get(c.name)) else missing).append(c)
    if missing and require_all:
        pkgs = " ".join(c.package for c in missing)
        raise PackError(f"documentation not installed for {[c.name for c in missing]}: "
                        f"apt-get install {pkgs} (or leave them out with --collections)")
    seen: set[bytes] = set()
    stats = []
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
            body = []
            for c in present:
                n = chars = dups = 0
                for doc_id, text in iter_collection(c, min_chars, roots.get(c.name)):
                    key = hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()
                    if key in seen:
                        dups += 1
                        continue
                    seen.add(key)
                    body.append(json.dumps({"source": c.name, "id": doc_id, "text": text}, ensure_ascii=False))
                    n += 1
                    chars += len(text)
                pkgs, unowned = installed_packages(collection_files(c, roots.get(c.name)), owners, versions)
                stats.append({"name": c.name, "package": c.package, "version": versions([c.package]).get(c.package),
                              "reader": c.reader, "documents": n, "characters": chars,
                              "duplicates_skipped": dups, "packages": pkgs, "unowned_files": unowned})
                say(f"[corpus-pack] {c.name}: {n:,} documents, {chars:,} characters")
            every = {k: v for st in stats for k, v in st["packages"].items()}
            header = {"format": PACK_FORMAT, "min_chars": min_chars, "collections": stats,
                      "packages": dict(sorted(every.items())),
                      "missing": [c.name for c in missing],
                      "documents": sum(s["documents"] for s in stats),
                      "characters": sum(s["characters"] for s in stats)}
            f.write(json.dumps({"header": header}, sort_keys=True) + "\n")
            for line in body:
                f.write(line + "\n")
    return header


def read_header(path: str | os.PathLike) -> dict:
    """The header of a pack (reads only its first line)."""
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            first = f.readline()
    except FileNotFoundError:
        raise PackError(f"{path}: pack not found (build it with `python -m lrattnres corpus-pack --out {path}`)") from None
    except (lzma.LZMAError, EOFError, OSError, UnicodeDecodeError) as e:
        raise PackError(f"{path}: not an xz-compressed pack ({e})") from None
    try:
        header = json.loads(first)["header"]
    except (ValueError, KeyError, TypeError):
        raise PackError(f"{path}: first line is not a pack header (expected {{\"header\": ...}})") from None
    if header.get("format") != PACK_FORMAT:
        raise PackError(f"{path}: format {header.get('format')!r}, expected {PACK_FORMAT!r}")
    return header


def iter_pack(path: str | os.PathLike) -> Iterator[tuple[str, str, str]]:
    """``(source, id, text)`` of every document of a pack, in pack order."""
    read_header(path)
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            f.readline()
            for lineno, line in enumerate(f, 2):
                try:
                    rec = json.loads(line)
                    yield rec["source"], rec["id"], rec["text"]
                except (ValueError, KeyError, TypeError):
                    raise PackError(f"{path}:{lineno}: not a document line (expected source, id, text)") from None
    except (lzma.LZMAError, EOFError) as e:
        raise PackError(f"{path}: truncated or corrupt ({e})") from None


def header_packages(header: dict) -> dict[str, str | None]:
    """{package: version} a pack was extracted from: its ``packages``, or, for a pack made before
    they were recorded, the collections' own packages."""
    if isinstance(header.get("packages"), dict):
        return dict(header["packages"])
    return {c["package"]: c.get("version") for c in header.get("collections", [])}


def version_diff(old: dict[str, str | None], new: dict[str, str | None]) -> list[tuple[str, str | None, str | None]]:
    """(package, old version, new version) of every package whose version differs, sorted; a package
    on one side only has None on the other."""
    return [(p, old.get(p), new.get(p)) for p in sorted(set(old) | set(new)) if old.get(p) != new.get(p)]


def diff_line(old: dict[str, str | None], new: dict[str, str | None], ref: str) -> str:
    """One line: which packages differ from the reference pack ``ref``, or that none do."""
    diff = version_diff(old, new)
    if not diff:
        return f"the same {len(new)} package versions as {ref}"
    items = "; ".join(f"{p} {o or 'absent'} -> {n or 'absent'}" for p, o, n in diff)
    return f"{len(diff)} of {len(set(old) | set(new))} packages differ from {ref}: {items}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres corpus-pack", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="the pack to write (.jsonl.xz)")
    p.add_argument("--collections", default=None,
                   help=f"comma-separated collection names (default: all of {[c.name for c in COLLECTIONS]})")
    p.add_argument("--min-chars", type=int, default=DEFAULT_MIN_CHARS, help="shortest document kept")
    p.add_argument("--allow-missing", action="store_true", help="leave out collections that are not installed")
    p.add_argument("--list", action="store_true", help="list the collections and their packages, then exit")
    p.add_argument("--compare", default=None, metavar="PACK",
                   help="say in one line which package versions differ from PACK's: those of the pack built "
                        "with --out, or without --out those installed here (exit 1 when they differ)")
    args = p.parse_args(argv)
    if args.list:
        for c in COLLECTIONS:
            print(f"{c.name:22s} {c.package:24s} {package_version(c.package) or 'not installed':24s} {c.why}")
        return 0
    if args.out is None and args.compare is None:
        p.error("expected --out (build a pack), --compare (check the installed versions) or --list")
    try:
        cols = by_name(args.collections.split(",") if args.collections else None)
        ref = header_packages(read_header(args.compare)) if args.compare else None
        if args.out is None:  # compare what is installed now, without building
            now, _ = installed_packages([f for c in cols for f in collection_files(c)])
            line = diff_line(ref, now, args.compare)
            print(f"corpus-pack: installed: {line}")
            return 0 if not version_diff(ref, now) else 1
        header = build_pack(args.out, cols, min_chars=args.min_chars, require_all=not args.allow_missing,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
    except (PackError, ValueError) as e:
        print(f"corpus-pack: {e}", file=sys.stderr)
        return 2
    print(f"corpus-pack: {args.out}: {header['documents']:,} documents, {header['characters']:,} characters, "
          f"{os.path.getsize(args.out):,} bytes", file=sys.stderr)
    if ref is not None:
        print(f"corpus-pack: {args.out}: {diff_line(ref, header_packages(header), args.compare)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
