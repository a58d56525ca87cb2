"""Routing diagnostics (Sections 4.6-4.7, Appendices C.4, C.5, D.1, E.2, G.1; Figures 4, 6-8, 10 right;
Tables 6 and 9).

``python -m lrattnres diagnostics --settings S.json --runs RUNS --data manifest.json --run ID
--out diagnostics/ID.json`` analyses one run (its model is needed, so a GPU machine runs it right after
training); ``python -m lrattnres diagnostics --settings S.json --published reports/published.yaml
--aggregate diagnostics/*.json --out diagnostics.json`` makes the figures and claims from the rows
(no model, no torch).

For every run of :func:`lrattnres.gridplan.plan` (run folder ``RUNS/<run_id>``):

* **Effective number of sources** per read site (Eq. 14): ``N_eff(t, x) = exp(H(alpha_t(x)))`` with
  ``H = -sum_i alpha_{t,i} log alpha_{t,i}`` over the sources of read t, averaged over the held-out
  tokens (the validation split, first ``tokens`` targets in order; the paper uses 1,007,616 tokens).
  ``n_eff[t-1]`` belongs to read t (after write t, t = 1..2L); the last entry is the final read, the
  one that feeds the head.  The embedding-only read before the first sub-layer has one source and no
  query; it is not listed.
* **Mean depth-wise attention** (Figure 8): ``heatmap[t-1][j]`` is the token-averaged weight that read t
  gives source j.  Source indexing: column 0 is the embedding o_0; column j >= 1 is block j, i.e. the
  sum of the writes ``block_ends[j-2]+1 .. block_ends[j-1]``.  A read inside block j sees that block as
  its current partial sum, in the same column j it will occupy once complete.  With full routing block
  j is write o_j.  Columns a read cannot see (later blocks) are ``null``; every row sums to 1.
* **Gradient norms** (Table 9, Figure 7, Figure 10 right): mean, population variance and the share of
  steps (in %) whose pre-clipping norm exceeds the clip threshold (the run's ``grad_clip``; 1 when it
  has none, the threshold of Table 9), from the ``train`` records of ``metrics.jsonl``; traces with a
  trailing mean over ``trailing_window`` steps.
* **Static-query utilisation** (Appendix E.2, Table 6): per query q_t (row t-1 of ``queries``; our
  routing RMSNorms are weightless, so the folded query of E.1 is q_t itself), the coordinate
  effective dimension ``D_eff = exp(-sum_j p_j log p_j)`` with ``p_j = q_j^2 / sum_k q_k^2``, and the
  fraction of exactly zero coordinates (no tolerance).  A query that is zero everywhere has no
  distribution; it counts in the zero fraction but not in D_eff (``n_zero_queries``).  Groups as in
  Table 6: ``pre_attention`` (reads after even writes t < 2L: they feed an attention sub-layer; the
  embedding-only first read has no query), ``pre_mlp`` (reads after odd writes), ``final_output``.

The scale's settings may carry a ``diagnostics`` block (:data:`DEFAULTS` lists its keys).  Claims
(``reports/published.yaml``, stage ``diagnostics``) map runs to the paper's rows as
:mod:`lrattnres.grid` does: :func:`lrattnres.gridplan.paper_row` (same method and N, same r/d), the roles of
Section 4.4 (headline, control) for the N = 8 rows, and the size pair (roles ``pair-small`` /
``pair-large``) for 1B / 4B.  Direction claims say in their note which runs stood in.

The modules: :mod:`~lrattnres.diagnostics.settings` (the ``diagnostics`` block),
:mod:`~lrattnres.diagnostics.measures` (the measures as functions of tensors and logged numbers),
:mod:`~lrattnres.diagnostics.analyse` (one run beside its model), :mod:`~lrattnres.diagnostics.summary`
(figures data and claims from the rows) and :mod:`~lrattnres.diagnostics.cli` (the command line).
Their public names are importable from ``lrattnres.diagnostics``.
"""

from __future__ import annotations

from lrattnres.diagnostics.analyse import analyse_run
from lrattnres.diagnostics.cli import diagnose, main, run_attention
from lrattnres.diagnostics.measures import (
    QUERY_GROUPS,
    RoutingAccumulator,
    coordinate_effective_dim,
    effective_sources,
    grad_norm_stats,
    query_group,
    query_utilisation,
    read_grad_norms,
    routing_diagnostics,
    source_columns,
    sources_per_read,
    trailing_mean,
    zero_fraction,
)
from lrattnres.diagnostics.settings import DEFAULTS, DEVICES, DiagnosticsError, validate_settings
from lrattnres.diagnostics.summary import SEGMENTS, aggregate, claims, fig6_runs, figures_data, n8_blocks, run_rows

__all__ = [
    "DEFAULTS", "DEVICES", "QUERY_GROUPS", "SEGMENTS", "DiagnosticsError", "RoutingAccumulator", "aggregate",
    "analyse_run", "claims", "coordinate_effective_dim", "diagnose", "effective_sources", "fig6_runs", "figures_data",
    "grad_norm_stats", "main", "n8_blocks", "query_group", "query_utilisation", "read_grad_norms", "routing_diagnostics",
    "run_attention", "run_rows", "source_columns", "sources_per_read", "trailing_mean", "validate_settings",
    "zero_fraction",
]
