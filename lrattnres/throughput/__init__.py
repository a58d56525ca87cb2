"""Training-step throughput with the protocol of Section 4.9 and Appendix I (Table 3).

``python -m lrattnres throughput --spec '<json>' --out RESULT.json [--data MANIFEST]``

Protocol (Appendix I, "Matched model comparison", "Measurement protocol", "Paired uncertainty"):

* Matched weights: per repeat one shared initialisation of the backbone (seeded), kept on the host
  (pinned on CUDA) and copied into every method's model; the routing queries (the only extra
  parameters of the timed methods) are zeros, the production initialisation.  Same seed, same cached
  tokens for every method.
* Compiled once: each method's model and (with ``compile``) its compiled loss module are built once
  per process and serve all of its repeats there: a run loads its repeat's shared weights into the
  same parameters and starts a fresh optimiser, so Dynamo compiles nothing again (each run records
  ``graphs_compiled`` and ``compile_s``). Between runs a model gives its device memory back: only the
  timed model is on the GPU. The paper's repeats are fresh processes; the result's ``protocol`` lists
  this and every other difference from Appendix I (:mod:`~lrattnres.throughput.comparison`).
* Cached tokens: one fixed host buffer of ``grad_accum`` micro-batches with production document
  boundaries (the first training batches of ``--data``'s train split, or synthetic tokens with
  log-normal document lengths ended by the end-of-text id), read once, transferred to the device in
  every update exactly as the trainer does.
* One timed update is the production step of ``lrattnres.train``: ``LossModule`` (bf16 autocast,
  cross-entropy + z-loss), ``accumulate_gradients`` (host-to-device transfer, forward, backward over
  ``grad_accum`` micro-batches, clipping) and ``apply_update`` (Muon + AdamW from
  ``optim.build_optimizers``, zero_grad); the device is synchronised before and after.  Compilation,
  storage reads, evaluation and logging are outside the timed region (compilation happens in the
  warm-up updates).
* ``warmup`` (3) updates, then ``min_updates``..``max_updates`` (8..30) measured updates, stopping
  by :func:`should_stop`; every measured update counts: v = tokens x n / sum(times).
* ``repeats`` (5) repeats per configuration, the method order rotated by one each repeat.
* Resolution (beyond the paper): with ``target_half_width`` (percentage points), more repeats of the
  ``resolve_gain`` gain's two methods (the rank gain: ``fused-rd4`` and ``fused-rd``) until its 95%
  half-width is at most the target, ``max_repeats`` repeats are done, or ``budget_s`` (seconds per
  size over all its commands) would be passed (:func:`more_repeats`); ``resolution`` says which.
* Paired gains ``g_j = 100 (v_j^A / v_j^B - 1)`` over repeats j, reported as mean and a 95%
  interval ``mean +- t_{0.975, n-1} s_g / sqrt(n)`` (:func:`paired_gain`).  The paper prints the
  half-width as ``t_{0.975,4} s_g / 5``; the standard error of a mean of n = 5 is s / sqrt(5), and
  dividing by 5 would shrink the interval by sqrt(5) -- we take that as a typo and use s / sqrt(n).

Methods (``methods`` spec key, any subset, in this rotation order):

=================  =========  =======================================================  ======
name               method     router                                                   r
=================  =========  =======================================================  ======
``baseline``       baseline   none: the plain PreNorm backbone (beyond the paper)      --
``fused-rd``       attnres    this project's kernel (``kernels.attnres``)              d
``fused-rd4``      lr         this project's kernel                                    d/4
``reference-rd4``  lr         the PyTorch reference (``routing.route``)                d/4
``fla-rd``         attnres    FLA's ``fused_attnres`` (fla-core), CUDA only            d
=================  =========  =======================================================  ======

The default ``methods`` are Table 3's three (``fla-rd``, ``fused-rd``, ``fused-rd4``); ``baseline`` and
``reference-rd4`` are extra rows a scale may add. All routed methods use N = ``blocks`` (8), clipped
to 2L for presets with fewer writes.  FLA is
wired as an alternative router through :func:`fla_router`, an adapter with weightless key RMS
(``rms_weight = ones``); it is skipped with a note where ``fla`` does not import or the device is
not CUDA.

Gains: ``rank`` (fused-rd4 / fused-rd: Table 3's rank gain), ``kernel`` (fused-rd4 / reference-rd4),
``combined_vs_fla`` (fused-rd4 / fla-rd: Section 4.9's combined gain), ``kernel_vs_fla``
(fused-rd / fla-rd), ``routing_rd4`` and ``routing_rd`` (routed / baseline: the cost of routing).

Claims: only for the paper's shapes (presets 1B and 4B) measured on a GPU: the direction claims of
Section 4.9 per GPU, ``sec4.9.{rank_gain_positive,fast_beats_fla,combined_gain_positive}.<gpu>.<size>``
with the per-repeat paired gains as evidence (a GPU of the same architecture stands in for the
paper's: :data:`GPU_STAND_INS`), Appendix I's stopping rule (``appI.repeats_met_stopping_rule.<size>``:
the timed runs that did not converge); the value claims of Table 3 only when the GPU is one of the
paper's (H100, B200), under those ids.  Smaller scales produce no claims (the numbers are shown in
the report beside the paper's, marked as a different scale and hardware).

Memory and failures: before it builds anything the stage estimates its peak GPU memory per size and
method (:func:`lrattnres.memory.throughput_estimate`) and refuses a plan that exceeds the scale's
``cluster.gpu_memory_gib`` (``--cluster``) or this GPU's memory, less ``cluster.memory_margin``
(exit 2). A method that runs out of GPU memory fails the job naming it (:class:`MethodFailed`, exit
1); another failing method is dropped from the comparison and listed under ``skipped``.

Resuming and deadlines: the workflow times one size per job (``{results}/throughput/<preset>.json``,
merged by ``--aggregate``). After every timed run the stage rewrites a partial state beside its
output (``<preset>.partial.json``: the finished runs, with the spec, device, data and code they were
made with); a rerun of the same spec on the same device continues from it, and a complete run
removes it. Under ``LRATTNRES_DEADLINE`` (lrattnres/deadline.py) no run starts that would not end
before the deadline (the longest finished run of the size is the estimate) and a run under way
stops between updates; the stage then exits 75 with its partial state kept, so that a retry, or a
later GPU command of lrattnres/pieces.py, continues it.

The modules: :mod:`~lrattnres.throughput.spec` (methods, gains, the spec and its check),
:mod:`~lrattnres.throughput.protocol` (the stopping rule, the interval and the gains: pure functions,
tested in tests/test_throughput.py), :mod:`~lrattnres.throughput.matched` (the cached tokens and the
matched models), :mod:`~lrattnres.throughput.measure` (the timed runs and the protocol over them),
:mod:`~lrattnres.throughput.summary` (claims, and the merge of single sizes),
:mod:`~lrattnres.throughput.partial` (the state a rerun continues) and
:mod:`~lrattnres.throughput.cli` (the command line). The package itself imports none of them, so
that reading the spec (lrattnres/jobplan.py estimates a timing job's wall time from it) loads
nothing else.
"""
