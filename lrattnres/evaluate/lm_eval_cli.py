"""``python -m lrattnres lm-eval <lm-eval's arguments>``: lm-eval's own command line, our model known.

    python -m lrattnres evaluate-tasks --out lm_eval_tasks --tasks arc_easy --limit 40
    python -m lrattnres lm-eval --model lrattnres \\
        --model_args checkpoint=results/tiny/runs/<run>/model.pt,device=cpu,batch_size=16 \\
        --tasks arc_easy --include_path lm_eval_tasks

lm-eval 0.4.13 resolves ``--model`` in its model registry, which holds its built-in models and any
class registered by a module already imported; its command line imports no outside package (it has
no plugin entry point).  This imports ``lrattnres.evaluate.adapter``, which registers
``lrattnres`` (``LRAttnResLM``, built from ``--model_args`` by ``create_from_arg_string``), then hands
the arguments unchanged to lm-eval's entry point (``lm_eval.__main__.cli_evaluate``): every option of
``lm-eval run`` works, and ``lm-eval ls``/``validate`` too.  The offline task data need no network;
``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set unless given.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lrattnres.evaluate.adapter  # noqa: F401  (registers the "lrattnres" model)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse's --help and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
