import os

# Triton keeps compiled kernels in one cache folder per user, which processes that start at once and
# compile the same kernels share. LRATTNRES_TRITON_CACHE_ROOT=<dir> gives each process a cache of its
# own (<dir>/<pid>), for machines that run several GPU jobs side by side. Set before triton loads.
_root = os.environ.get("LRATTNRES_TRITON_CACHE_ROOT")
if _root and "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_root, str(os.getpid()))

from lrattnres.cli import main  # noqa: E402

raise SystemExit(main())
