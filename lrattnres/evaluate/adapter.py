"""lm-eval ``LM`` adapter for our checkpoints, with the protocol of Appendix G.

The adapter takes any torch module with the contract ``model(input_ids, doc_ids=None) -> logits
[B, T, V]`` and a tokenizer with ``.encode(text) -> list[int]`` (``lrattnres.data.Tokenizer``, which
maps to the compacted ids of the small scales), so it runs with a tiny random model in the tests.

Protocol (Appendix G):

* no chat template and no beginning-of-sequence token; the end-of-text id is prepended only when
  the prompt (context) is empty, so the first continuation token has something to condition on;
* batches of ``batch_size`` (paper: 8) requests, causal right padding (padding sits after every real
  token, so under a causal mask it cannot change the logits of real positions);
* bf16 model computation on a GPU (autocast), log-probabilities in fp32 (``log_softmax`` of the
  logits cast to fp32); on the CPU the model runs in fp32 unless asked otherwise;
* over-long inputs are truncated on the left to ``max_length`` tokens, always keeping the whole
  continuation; a continuation longer than the window itself (possible only with the small
  scales' 64-128-token windows) is scored in consecutive chunks, each conditioned on the longest
  left context that fits (``chunk_continuation``), so the whole answer is still scored;
* boundary whitespace is preserved. Tokenisation follows lm-eval's HFLM convention: trailing
  whitespace of the context is moved onto the continuation, then ``whole = encode(context +
  continuation)``, ``ctx = encode(context)`` and the continuation's tokens are ``whole[len(ctx):]``.
  Moving the whitespace is what "preserved" needs with cl100k-style BPE, whose pre-tokeniser glues
  a space to the word after it: ``"Answer: yes"`` is ``Answer | : | ␣yes``; encoding the context
  ``"Answer: "`` alone would end in a lone ``␣`` token, so ``whole[len(ctx):]`` would drop the
  ``␣yes`` token. After the move the context's tokens are a prefix of the whole string's and the
  whitespace is scored inside the continuation's first token, exactly as in running text. Where BPE
  still merges across the boundary (rare; a context ending mid-word), the split is HFLM's, and
  the adapter counts such requests in ``stats["boundary_mismatch"]``.

From a training checkpoint (``from_checkpoint``; lm-eval's ``--model_args`` through
``create_from_arg_string``/``create_from_arg_obj``): ``checkpoint`` (model.pt or checkpoint.pt of a
run), ``data`` (the run's data manifest, whose tokenizer and vocabulary compaction the model was
trained with; default: the one the run folder's spec.json records), ``device`` (auto | cpu | cuda
| cuda:N), ``batch_size``, ``max_length`` (default: the model's max_seq_len), ``precision``.  Values
in ``--model_args`` win over lm-eval's own ``--device``/``--batch_size``; lm-eval's default device
(``cuda:0``) falls back to the CPU, with a warning, where CUDA is absent (as lm-eval's HFLM does).

``loglikelihood_rolling`` uses lm-eval's own rolling windows (``get_rolling_token_windows`` with the
end-of-text id as prefix token, windows of ``max_length``, disjoint). ``generate_until`` is not
supported: the paper's eight tasks only score continuations.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from lrattnres.attention import describe
from lrattnres.data import load_manifest, load_tokenizer
from lrattnres.devices import resolve_device
from lrattnres.progress import bar as progress_bar
from lrattnres.train.checkpoint import load_model

log = logging.getLogger("lrattnres.evaluate")

try:  # lm-eval is needed for evaluation, not for importing the scoring core
    from lm_eval.api.model import LM as _LMBase
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - lm-eval missing
    _LMBase = object

    def register_model(*_names):
        return lambda cls: cls


def _find_eot(tokenizer: Any) -> int:
    for attr in ("eot_id", "eot", "eot_token", "eos_token_id", "eot_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    raise ValueError(
        "the tokenizer exposes no end-of-text id (looked for eot_id, eot, eot_token, eos_token_id); "
        "pass eot_id= to the adapter"
    )


def split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """Move trailing whitespace of ``context`` onto the front of ``continuation`` (HFLM convention)."""
    n = len(context) - len(context.rstrip())
    if n:
        return context[:-n], context[-n:] + continuation
    return context, continuation


def truncate_left(context_enc: list[int], continuation_enc: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Drop context tokens from the left so that the model input (context + continuation minus
    its last token) fits in ``max_length``; the continuation is always kept whole."""
    if len(continuation_enc) == 0:
        raise ValueError("empty continuation: nothing to score")
    if len(continuation_enc) > max_length:
        raise ValueError(
            f"continuation of {len(continuation_enc)} tokens does not fit the {max_length}-token context; "
            "Appendix G keeps the whole answer, so this request cannot be scored"
        )
    keep_ctx = max_length + 1 - len(continuation_enc)
    if len(context_enc) > keep_ctx:
        context_enc = context_enc[len(context_enc) - keep_ctx :]
    return context_enc, continuation_enc


def chunk_continuation(context_enc: list[int], continuation_enc: list[int], max_length: int):
    """Split a continuation longer than the window into consecutive chunks of at most
    ``max_length`` tokens, each paired with everything before it (``truncate_left`` then keeps the
    longest left context that fits). A continuation that fits is returned as one pair.

    Appendix G keeps the whole answer; with the paper's 2048-token window no answer comes close. The
    small scales' windows (64-128 tokens) can be shorter than a long PIQA or HellaSwag answer; the
    answer is then still scored in full, token by token, as ``loglikelihood_rolling`` scores a text.
    """
    if len(continuation_enc) <= max_length:
        return [(context_enc, continuation_enc)]
    seq = context_enc + continuation_enc
    out, a = [], len(context_enc)
    while a < len(seq):
        b = min(a + max_length, len(seq))
        out.append((seq[:a], seq[a:b]))
        a = b
    return out


@register_model("lrattnres")
class LRAttnResLM(_LMBase):
    """lm-eval ``LM`` over a ``model(input_ids, doc_ids=None) -> logits`` module."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        batch_size: int = 8,
        max_length: int = 2048,
        device: str | torch.device | None = None,
        precision: str = "auto",
        eot_id: int | None = None,
        pad_id: int | None = None,
        progress: bool = False,
    ) -> None:
        if _LMBase is not object:
            super().__init__()
        else:  # pragma: no cover
            self._rank, self._world_size = 0, 1
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(max_length) < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        if device is None:
            try:
                device = next(model.parameters()).device
            except StopIteration:
                device = "cpu"
        self._device = torch.device(device)
        if precision == "auto":
            precision = "bf16" if self._device.type == "cuda" else "fp32"
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
        self.precision = precision
        self.eot_id = int(eot_id) if eot_id is not None else _find_eot(tokenizer)
        self.pad_id = int(pad_id) if pad_id is not None else self.eot_id
        self.progress = progress
        self.stats = {"requests": 0, "forward_s": 0.0, "batches": 0, "tokens": 0, "truncated": 0, "chunked": 0, "boundary_mismatch": 0}
        self.model.eval()

    @property
    def device(self) -> torch.device:
        return self._device

    # -- construction from a checkpoint (lm-eval's --model_args) ------------------------------

    MODEL_ARGS = ("checkpoint", "data", "device", "batch_size", "max_length", "precision")

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path,
        data: str | Path | None = None,
        *,
        device: str = "auto",
        batch_size: int = 8,
        max_length: int | None = None,
        precision: str = "auto",
        progress: bool = False,
    ) -> "LRAttnResLM":
        """The adapter over a training run's weights; ``.checkpoint_info`` holds the checkpoint's
        records (spec, model_config, ...) and ``.manifest_path`` the data manifest used."""
        import json

        checkpoint = Path(checkpoint)
        if data is None:
            recorded = checkpoint.parent / "spec.json"
            try:
                data = json.loads(recorded.read_text())["data"]
            except (OSError, ValueError, KeyError):
                raise ValueError(f"{checkpoint}: no data manifest given and {recorded} records none; pass "
                                 "data=<the run's manifest.json> (its tokenizer and vocabulary)") from None
        device = str(resolve_device(device, error=ValueError))
        model, info = load_model(checkpoint, device)
        manifest = load_manifest(data)
        tok = load_tokenizer(manifest)
        mcfg = info.get("model_config", {})
        if mcfg.get("vocab_size") is not None and int(mcfg["vocab_size"]) != int(tok.vocab_size):
            raise ValueError(
                f"{checkpoint}: model vocab_size {mcfg['vocab_size']} does not match the tokenizer of {data} "
                f"(vocab_size {tok.vocab_size}); evaluate with the manifest the model was trained on")
        if info.get("manifest_sha256") and manifest.get("_sha256") and info["manifest_sha256"] != manifest["_sha256"]:
            log.warning("%s was trained on data manifest %s..., scoring with the tokenizer of %s (%s...); pass the "
                        "manifest it was trained on to score with its own tokenizer", checkpoint,
                        str(info["manifest_sha256"])[:12], data, str(manifest["_sha256"])[:12])
        model_len = mcfg.get("max_seq_len")
        length = max_length or model_len or 2048
        if model_len and length > int(model_len):
            log.warning("max_length %d exceeds the model's max_seq_len %d; using %d", length, model_len, model_len)
            length = int(model_len)
        lm = cls(model, tok, batch_size=batch_size, max_length=length, device=device, precision=precision,
                 progress=progress)
        lm.checkpoint_info, lm.manifest_path = info, str(data)
        return lm

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "LRAttnResLM":
        """lm-eval's constructor hook: ``arg_dict`` is ``--model_args`` (see the module docstring),
        ``additional_config`` lm-eval's ``--batch_size``/``--device`` (used where ``arg_dict`` has none)."""
        args = dict(arg_dict or {})
        unknown = sorted(set(args) - set(cls.MODEL_ARGS))
        if unknown:
            raise ValueError(f"lrattnres model_args: unknown key(s) {unknown}; expected {list(cls.MODEL_ARGS)}")
        if not args.get("checkpoint"):
            raise ValueError("lrattnres model_args: 'checkpoint' is required (model.pt or checkpoint.pt of a run)")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "device" not in args and "device" in extra:
            args["device"] = str(extra["device"])
            if args["device"].startswith("cuda") and not torch.cuda.is_available():
                log.warning("lrattnres: lm-eval's device %s is not available here; using the CPU "
                            "(give device=... in --model_args to choose)", args["device"])
                args["device"] = "cpu"
        if "batch_size" not in args and "batch_size" in extra:
            args["batch_size"] = extra["batch_size"]
        bs = args.get("batch_size", 8)
        try:
            args["batch_size"] = int(bs)
        except (TypeError, ValueError):
            raise ValueError(f"lrattnres model_args: batch_size must be a positive integer, got {bs!r} "
                             "(automatic batch sizes are not supported)") from None
        if args.get("max_length") is not None:
            args["max_length"] = int(args["max_length"])
        checkpoint = args.pop("checkpoint")
        return cls.from_checkpoint(checkpoint, **args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "LRAttnResLM":
        """``checkpoint=...,device=...,batch_size=...`` (lm-eval's ``--model_args`` string)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- tokenisation -----------------------------------------------------------------------

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation) under the protocol (see the module docstring)."""
        context, continuation = split_whitespace(context, continuation)
        if context == "":
            return [self.eot_id], self.tok_encode(continuation)
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        if whole[: len(ctx)] != ctx:
            self.stats["boundary_mismatch"] += 1
        return ctx, whole[len(ctx) :]

    # -- scoring core -----------------------------------------------------------------------

    @torch.no_grad()
    def _forward_logits(self, inputs: list[list[int]]) -> torch.Tensor:
        """Logits [B, T, V] of right-padded ``inputs`` (model dtype; cast to fp32 per row later)."""
        width = max(len(x) for x in inputs)
        batch = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)
        for i, x in enumerate(inputs):
            batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        batch = batch.to(self.device)
        if self.precision == "bf16":
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                logits = self.model(batch, doc_ids=None)
        else:
            logits = self.model(batch, doc_ids=None)
        self.stats["tokens"] += sum(len(x) for x in inputs)
        return logits

    @torch.no_grad()
    def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), greedy)`` for token-id pairs, batched.

        Requests are processed longest first (fewer pad tokens per batch) and returned in input order.
        """
        prepared = []  # (model input, continuation chunk)
        owner = []  # request index of each prepared row
        for k, (ctx, cont) in enumerate(pairs):
            ctx, cont = list(ctx), list(cont)
            if len(ctx) == 0:  # encode_pair never yields this; keep the first token scorable
                raise ValueError("empty context: prefix the end-of-text id")
            if len(ctx) + len(cont) - 1 > self.max_length:
                self.stats["truncated"] += 1
            for c_ctx, c_cont in chunk_continuation(ctx, cont, self.max_length):
                c_ctx, c_cont = truncate_left(c_ctx, c_cont, self.max_length)
                full = c_ctx + c_cont
                prepared.append((full[:-1], c_cont))
                owner.append(k)
            if len(cont) > self.max_length:
                self.stats["chunked"] += 1
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        scored: list[tuple[float, bool] | None] = [None] * len(prepared)
        t0 = time.perf_counter()
        it = range(0, len(order), self.batch_size)
        if self.progress:  # a live bar on a terminal, plain lines in a log file

            it = progress_bar(it, desc="loglikelihood", unit="batch")
        for start in it:
            idx = order[start : start + self.batch_size]
            logits = self._forward_logits([prepared[i][0] for i in idx])
            # fp32 log-probabilities at the continuations' positions only, all rows at once
            rows, pos, tgt, seg = [], [], [], []
            for row, i in enumerate(idx):
                inp, cont = prepared[i]
                n = len(cont)
                rows += [row] * n
                pos += range(len(inp) - n, len(inp))
                tgt += cont
                seg += [row] * n
            dev = logits.device
            rows_t = torch.tensor(rows, device=dev)
            pos_t = torch.tensor(pos, device=dev)
            tgt_t = torch.tensor(tgt, device=dev)
            step = F.log_softmax(logits[rows_t, pos_t].float(), dim=-1)  # [M, V]
            tok_ll = step.gather(-1, tgt_t[:, None]).squeeze(-1)
            hit = (step.argmax(-1) == tgt_t).to(torch.float32)
            seg_t = torch.tensor(seg, device=dev)
            ll = torch.zeros(len(idx), dtype=torch.float64, device=dev).index_add_(0, seg_t, tok_ll.double())
            misses = torch.zeros(len(idx), device=dev).index_add_(0, seg_t, 1.0 - hit)
            ll, misses = ll.tolist(), misses.tolist()  # one device sync per batch
            for row, i in enumerate(idx):
                scored[i] = (float(ll[row]), misses[row] == 0)
            self.stats["batches"] += 1
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["requests"] += len(pairs)
        results = [(0.0, True)] * len(pairs)
        for k, (ll, greedy) in zip(owner, scored):  # type: ignore[misc]
            results[k] = (results[k][0] + ll, results[k][1] and greedy)
        return results

    # -- lm-eval API ------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args[:2]) for req in requests]
        results = self.score_tokens(pairs)
        hook = getattr(self, "cache_hook", None)
        if hook is not None:
            for req, res in zip(requests, results):
                hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args[:1]
            tokens = self.tok_encode(text)
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.eot_id, max_seq_len=self.max_length, context_len=1
                )
            ]
            scores = self.score_tokens([(list(c), list(t)) for c, t in windows])
            out.append(float(sum(s for s, _ in scores)))
            hook = getattr(self, "cache_hook", None)
            if hook is not None:
                hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "LRAttnResLM scores continuations only (loglikelihood, loglikelihood_rolling); "
            "generation tasks are outside the paper's Appendix G protocol"
        )

    # -- bookkeeping ------------------------------------------------------------------------

    def requests_per_s(self) -> float | None:
        s = self.stats["forward_s"]
        return self.stats["requests"] / s if s > 0 else None

    def attention(self) -> dict | None:
        """The attention the scoring forward runs (``lrattnres.attention.describe``; the requests carry
        no document ids, so plain causal SDPA), or None for a module without a model config."""
        requested = getattr(getattr(self.model, "cfg", None), "attention", None)
        if requested is None:
            return None

        return describe(requested, self.device, documents=False)

    def get_model_info(self) -> dict:
        return {
            "adapter": "lrattnres.evaluate.adapter.LRAttnResLM",
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "precision": self.precision,
            "device": str(self.device),
            "attention": self.attention(),
        }
