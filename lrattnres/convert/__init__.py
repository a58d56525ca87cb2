"""Checkpoint conversion (Section 4.8, Appendix B.1-B.2, Table 2): AttnRes -> LR-AttnRes, no retraining.

A standard AttnRes checkpoint (method ``attnres``, r = d, full or N-block routing) becomes a
full-width-RMS LR-AttnRes checkpoint (method ``lr-fullrms``, same blocks, rank r) with the same
routing distributions and logits in exact arithmetic, whenever r >= k = rank(Q).

The construction (Proposition 1)
--------------------------------
* Active queries.  The model has one static query per read after a write: ``queries[t-1]`` serves the
  read after write t, t = 1..2L (the last feeds the head).  The embedding-only first read is the
  identity and needs none.  So the active queries are all 2L rows of ``queries``, stacked into
  Q = [q_1 .. q_2L] in R^{d x 2L}.  (Every read mixes at least two sources, the embedding and the
  latest write or block, so no query is inert.)
* Folding.  A routing RMSNorm with an affine weight gamma_t scores ``q_t . (gamma_t * o / rho_d(o))``
  = ``(gamma_t * q_t) . o / rho_d(o)``, so the effective query is ``gamma_t * q_t``
  (:func:`effective_queries`).  This model's routing norms are weightless (gamma = 1), so the fold
  is the identity here; pass ``routing_norm_weight`` to convert a checkpoint that has them.  (Affine
  weights of the sub-layer input norms would likewise be folded into the columns of the input
  projections before rotating, as in SliceGPT; this backbone has none, and the rotation refuses any
  parameter it does not know.)
* Span and rank.  Q is cast to float64 and decomposed, Q = U S V^T (full U, d x d).  The joint rank
  k is the numerical rank: the number of singular values above ``rtol * s_max`` with
  ``rtol = max(d, 2L) * eps_float64`` by default (NumPy's ``matrix_rank`` rule; ``spec.rtol``
  overrides it).  The float64 tolerance is deliberately tight: stored fp32 queries cast exactly to
  float64, so k is the rank of the stored numbers, and a conversion at r >= k is exact to float64
  rounding.  U[:, :k] is an orthonormal basis of the span; U[:, k:] completes it.
* Change of coordinates.  For r >= k the new basis is B = [U[:, r:], U[:, :r]] (the top r left
  singular vectors, which contain the span, last) and R = B^T (d x d, orthogonal).  R maps the span
  onto e_{d-r+1..d}: R q has zeros in its first d - r coordinates, so keeping its last r is exact.
* Weights (column-vector activations h' = R h; nn.Linear stores [out, in]):
  residual-facing input projections W' = W R^T (``attn.qkv``, ``mlp.gate_up``, ``head``), output
  projections W' = R W (``attn.out``, ``mlp.down``), embedding rows e' = R e (table E' = E R^T),
  residual-output biases b' = R b (none in this model), queries q' = (R q)[d-r:].  Weightless RMSNorm
  commutes with R (rho_d(R o) = rho_d(o)), QK-norm and RoPE act inside the heads after the QKV
  projection, so they are untouched; so do block sums (linear).  All of it is absorbed into existing
  parameters: the converted model has no extra rotation.

Checks (Table 2, Appendix B.2)
------------------------------
* ``fp64_max_logit_err``: both models cast to float64 (reference router, SDPA attention), logits on
  one full-length sequence (``max_seq_len`` tokens: the first window of the validation split, with
  its document mask), max |difference|; ``logit_scale`` = max |logit| for relative statements.  The
  converted float64 model is the one compared (the paper verifies FP64 logits, then exports).  The
  claim ``table2.fp64_max_err.<row>`` carries this absolute difference (Table 2's quantity, bound
  1e-9); the note gives it relative to the logit scale.  ``fp64_noise_floor`` is how far the
  original's float64 logits move when every weight gets one float64 rounding of noise: a model with
  large, sharp routing scores amplifies rounding (random models with queries of norm ~16 at d = 1024
  reach 1e-6), so the error is read against that floor.  ``exported_max_logit_err`` is the same
  difference for the converted weights as exported (BF16 by default), ``exported_original_max_logit_err``
  the original's after the same export: what the export's rounding alone moves.
* Export and reload (Appendix B.2: "export and strictly reload the BF16 checkpoints"): the original
  and the converted weights are written as checked safetensors in ``spec.export_dtype`` (``bf16``,
  the default; ``storage``: the checkpoint's own dtype), read back through ``load_model`` (sha256,
  every parameter of the recorded architecture) and compared with what was written. On a GPU the
  reloaded models' fused routing is compared with the reference on the FP64 check's sequence
  (``native_vs_reference_max_logit_err``, bf16).
* Paired validation cross-entropy of the *reloaded* original and converted models (Table 2: "BF16
  model computation, FP32 per-token cross-entropy, and FP64 summation"): the same windows of the
  validation split, bf16 autocast on a GPU and fp32 on the CPU (``spec.precision``), fp32 per-token
  CE, fp64 sums; ``delta_ce`` = converted minus original.
* ``joint_rank`` and ``active_queries`` (= 2L).
* Slice drift: the converted weights run with slice normalisation (method ``lr``: RMS over the last r
  coordinates only).  The theorem does not cover it; the drift is reported, not claimed.

CLI::

    python -m lrattnres convert --checkpoint results/<scale>/runs/<run>/model.safetensors --data <manifest.json>
        --spec '{"rank": "d/8", "val_tokens": null, "batch_size": 8, "claim_row": "0.5b.nfull"}'
        --out convert.json [--save converted/model.safetensors]
    python -m lrattnres convert --aggregate a.json b.json ... --out convert_all.json

Spec keys: ``rank`` (int, "d", "d/<n>" or "k" = the joint rank), ``val_tokens`` (int target tokens or
null = the whole split), ``batch_size``, ``claim_row`` ("<size>.n<N>", e.g. "0.5b.nfull", "1b.n8", or
null), optional ``precision`` ("auto" | "bf16" | "fp32"), ``device`` ("auto" | "cpu" | "cuda[:i]"),
``rtol`` (float or null), ``seq_len`` (CE window length; default: the training spec's, else
max_seq_len), ``export_dtype`` ("bf16" | "storage"; default "bf16").

The modules: :mod:`~lrattnres.convert.construction` (the span, the rotation, the rotated weights),
:mod:`~lrattnres.convert.verify` (logit differences and the paired cross-entropy),
:mod:`~lrattnres.convert.runner` (one conversion end to end), :mod:`~lrattnres.convert.summary` (the
claims, and the combination of several results) and :mod:`~lrattnres.convert.cli` (the command line).
Their public names are importable from ``lrattnres.convert``.
"""

from __future__ import annotations

from lrattnres.convert.cli import main
from lrattnres.convert.construction import (
    Conversion,
    QuerySpan,
    RankError,
    convert_model,
    default_rtol,
    effective_queries,
    query_span,
    rotate_state_dict,
    rotation,
    with_config,
)
from lrattnres.convert.runner import SPEC_KEYS, SPEC_REQUIRED, run, validate_spec
from lrattnres.convert.summary import (
    DEFAULT_PUBLISHED,
    SIZES,
    aggregate,
    aggregate_results,
    invariant_summary,
    parse_claim_row,
    published_records,
    result_claims,
)
from lrattnres.convert.verify import _fp64_view, fp64_noise_floor, max_logit_diff, max_logit_diff_to, paired_ce

__all__ = [
    "DEFAULT_PUBLISHED", "SIZES", "SPEC_KEYS", "SPEC_REQUIRED", "Conversion", "QuerySpan", "RankError", "_fp64_view",
    "aggregate", "aggregate_results", "convert_model", "default_rtol", "effective_queries", "fp64_noise_floor",
    "invariant_summary", "main", "max_logit_diff", "max_logit_diff_to", "paired_ce", "parse_claim_row",
    "published_records", "query_span", "result_claims", "rotate_state_dict", "rotation", "run", "validate_spec",
    "with_config",
]
