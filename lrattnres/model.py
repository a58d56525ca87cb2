"""The language model: a PreNorm Transformer whose residual stream is routed across depth.

Writes are o_0 = the token embedding and o_1..o_2L = the outputs of the attention and MLP
sub-layers (no residual add inside a sub-layer).  Before sub-layer t+1 the model *reads* a state
h_t from the writes so far, and the sub-layer sees RMSNorm(h_t); the head sees RMSNorm(h_2L).

* ``baseline``: h_t = o_0 + o_1 + ... + o_t (the ordinary residual sum).
* routed methods: h_t = sum_i softmax_i(q_t . RMSNorm(k_i)) v_i over the sources of the read after
  write t (``routing.SourceBank``: the embedding, completed block sums, the current partial sum;
  with ``blocks="full"`` every write is a source).  Query t ([2L, r] parameter, zero at init) serves
  the read after write t; the embedding-only first read needs none (it is the identity).  Keys:

  - ``attnres``: the whole source (r = d), standard AttnRes;
  - ``lr``: the last r coordinates of the source, RMS over those r (LR-AttnRes);
  - ``lr-fullrms``: RMS over all d coordinates, then the last r (the control of Eq. 13);
  - ``plr``: a learned r-wide key k_i = W_i^K a_i, where a_i is the input of write i's output
    projection (attention output before ``out``, width d; SwiGLU hidden, width m), and
    k_0 = W_0^K o_0; a block's key is the sum of its writes' keys, RMS over r (Appendix C).

Backbone (the author's repository): weightless RMSNorm everywhere, per-head weightless QK-norm
before RoPE (interleaved pairs, base 500,000), fused QKV, SwiGLU silu(gate) * up, no biases, untied
embedding and head, every Linear and embedding weight N(0, init_std), queries zero.

Parameter names (stable; the conversion stage rotates them):

    embed.weight                      [V, d]
    layers.{i}.attn.qkv.weight        [3d, d]   rows: q (all heads), k, v; head h = rows h*hd:(h+1)*hd
    layers.{i}.attn.out.weight        [d, d]
    layers.{i}.mlp.gate_up.weight     [2m, d]   rows: gate, up
    layers.{i}.mlp.down.weight        [d, m]
    head.weight                       [V, d]
    queries                           [2L, r]   routed methods; row t-1 serves the read after write t
    embed_route_key.weight            [r, d]    plr: W_0^K
    layers.{i}.attn.route_key.weight  [r, d]    plr: W^K of write 2i+1
    layers.{i}.mlp.route_key.weight   [r, m]    plr: W^K of write 2i+2

Precision: routing runs in fp32 (fp64 for an fp64 model).  Under autocast the residual stream (the
baseline's running sum; the routed methods' sources) is stored in the autocast dtype
(``stream_dtype="autocast"``, the default: bf16 sources, as in the paper and as the published kernels
require), or in the embedding's dtype (``"param"``: fp32 sources, twice the bytes per routing read).
Every write is cast to the stream's dtype, so all sources of a read share one dtype.

Activation checkpointing (``model.activation_checkpointing``, set by the trainer from its spec): each
layer's two writes and reads are recomputed in the backward (``torch.utils.checkpoint`` per layer,
the non-reentrant form that torch.compile traces); the routing banks' states pass through the layer
as its inputs and outputs, so only the layer boundaries are kept. The gradients are the same.

Router: ``reference`` mixes with ``routing.route``; ``fused`` with ``kernels.attnres`` (imported on
first use); ``auto`` = fused on CUDA when ``kernels`` imports, reference otherwise.  ``plr`` scores
its projected keys in PyTorch (``routing.route_keys``); so does any forward that returns routing
weights, which cost nothing unless requested.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrattnres.attention import BACKENDS, make_attention
from lrattnres.checks import is_int
from lrattnres.segments import Segments
from lrattnres.presets import get_preset
from lrattnres.routing import SourceBank, rms_norm, route, route_keys

METHODS = ("baseline", "attnres", "lr", "lr-fullrms", "plr")
ROUTERS = ("auto", "reference", "fused")
STREAM_DTYPES = ("autocast", "param")
DEFAULT_RANK = 128  # the rank of a routed model given none: the paper's headline rank of the 0.5B model
KEY_NORM = {"attnres": "slice", "lr": "slice", "lr-fullrms": "full"}  # plr normalises its own keys


@dataclass
class ModelConfig:
    """Shape and routing variant of one model; ``__post_init__`` rejects what the model cannot be."""

    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    method: str = "lr"
    blocks: int | str = 8  # "full" or the number of routing blocks N (1 <= N <= 2L)
    rank: int | None = None  # routing-key width r; None: r = d for attnres, DEFAULT_RANK otherwise
    norm_eps: float = 1e-6
    rope_base: float = 500000.0
    init_std: float = 0.02
    router: str = "auto"
    attention: str = "auto"
    stream_dtype: str = "autocast"  # residual stream / sources under autocast: "autocast" or "param"

    def __post_init__(self):
        def bad(field, expected):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: expected {expected}")

        for field in ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "max_seq_len"):
            if not is_int(getattr(self, field)) or getattr(self, field) < 1:
                bad(field, "a positive int" + (" (small presets take it from the data manifest)" if field == "vocab_size" else ""))
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            bad("n_heads", f"a divisor of d_model={self.d_model} leaving an even head width (RoPE rotates pairs)")
        if self.method not in METHODS:
            bad("method", f"one of {METHODS}")
        if self.router not in ROUTERS:
            bad("router", f"one of {ROUTERS}")
        if self.attention not in BACKENDS:
            bad("attention", f"one of {BACKENDS}")
        if self.stream_dtype not in STREAM_DTYPES:
            bad("stream_dtype", f"one of {STREAM_DTYPES}")
        if not self.norm_eps >= 0:
            bad("norm_eps", "a float >= 0")
        if self.rank is None:  # no rank given: standard AttnRes routes with r = d
            self.rank = self.d_model if self.method == "attnres" else DEFAULT_RANK
        if self.method == "baseline":
            return
        if not is_int(self.rank) or not 1 <= self.rank <= self.d_model:
            bad("rank", f"an int r with 1 <= r <= d_model={self.d_model}")
        if self.method == "attnres" and self.rank != self.d_model:
            bad("rank", f"r = d_model = {self.d_model} for method 'attnres' (standard AttnRes routes with r = d)")
        if self.blocks != "full" and not (is_int(self.blocks) and 1 <= self.blocks <= 2 * self.n_layers):
            bad("blocks", f"'full' or an int N with 1 <= N <= 2L = {2 * self.n_layers}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def model_config(spec) -> ModelConfig:
    """A ModelConfig from a ModelConfig, a preset name, or a dict (``{"preset": name, **overrides}``
    or every field).  A rank not given is ModelConfig's: r = d for ``attnres``."""
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        spec = {"preset": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"model config must be a ModelConfig, a preset name or a dict, got {type(spec).__name__}")
    spec = dict(spec)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(spec) - fields - {"preset"})
    if unknown:
        raise ValueError(f"unknown model config field(s) {unknown}; expected 'preset' and/or {sorted(fields)}")
    preset = spec.pop("preset", None)
    values = {} if preset is None else get_preset(preset)
    values.update(spec)
    if values.get("vocab_size") is None and preset is not None:
        raise ValueError(f"vocab_size: preset {preset!r} takes it from the data manifest; pass vocab_size with it")
    missing = sorted(f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING and f.name not in values)
    if missing:
        raise ValueError(f"model config lacks field(s) {missing} (or name a 'preset')")
    return ModelConfig(**values)


def build_model(spec) -> LRAttnResLM:
    """The model of a ModelConfig, a preset name, or a dict; weights initialised, on the CPU."""
    return LRAttnResLM(model_config(spec))


def count_parameters(spec) -> int:
    """Parameter count of a config without allocating any weights (built on the meta device)."""
    with torch.device("meta"):
        return LRAttnResLM(model_config(spec)).num_parameters()


# ---------------------------------------------------------------------------------------------
# backbone


def rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim/2]: pair j rotates at frequency base^(-2j/head_dim)."""
    # built on the CPU even under a meta-device context (arange on meta is needlessly slow to start)
    freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    angle = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device="cpu"), freq)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2j], x[2j+1]) of x [B, H, T, hd] by position."""
    wide = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(wide)[..., 0::2], x.to(wide)[..., 1::2]
    cos, sin = cos.to(wide), sin.to(wide)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with QK-norm and RoPE; returns (o, routing key or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.eps = cfg.n_heads, cfg.norm_eps
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.route_key = nn.Linear(cfg.d_model, cfg.rank, bias=False) if cfg.method == "plr" else None

    def forward(self, x, cos, sin, attend):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q = apply_rope(rms_norm(q, self.eps), cos, sin)
        k = apply_rope(rms_norm(k, self.eps), cos, sin)
        a = attend(q, k, v).transpose(1, 2).reshape(B, T, d)
        return self.out(a), (None if self.route_key is None else self.route_key(a))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate) * up); returns (o, routing key or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.route_key = nn.Linear(cfg.d_ff, cfg.rank, bias=False) if cfg.method == "plr" else None

    def forward(self, x, cos, sin, attend):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        a = F.silu(gate) * up
        return self.down(a), (None if self.route_key is None else self.route_key(a))


class Layer(nn.Module):
    """One Transformer block: two writers, attention then MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)


def _checkpointed(fn, *args):
    """``fn(*args)`` with its activations recomputed in the backward (torch.utils.checkpoint, the
    non-reentrant form, which torch.compile traces and which takes the banks' states as arguments)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


@functools.cache
def _kernels():
    """The ``kernels`` package, or None where it does not import."""
    try:
        import kernels
    except ImportError:
        return None
    return kernels


class LRAttnResLM(nn.Module):
    """The decoder of every method: embedding, L layers (2L writers), depth reads, head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, r, n_writes = cfg.d_model, cfg.rank, 2 * cfg.n_layers
        # _weight skips nn.Embedding's own init, which is slow to start on the meta device; ours follows
        self.embed = nn.Embedding(cfg.vocab_size, d, _weight=torch.empty(cfg.vocab_size, d))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.method != "baseline":
            self.queries = nn.Parameter(torch.zeros(n_writes, r))
        if cfg.method == "plr":
            self.embed_route_key = nn.Linear(d, r, bias=False)
        # recompute each layer's activations in the backward instead of keeping them (set by the
        # trainer from its spec; an execution setting: the gradients are the same)
        self.activation_checkpointing = False
        cos, sin = rope_tables(d // cfg.n_heads, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos.to(self.embed.weight.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.embed.weight.device), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and not m.weight.is_meta:  # meta: counting only
                nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def sublayers(self) -> list[nn.Module]:
        """The 2L writers in order: write t (1-based) is sublayers()[t-1]."""
        return [m for layer in self.layers for m in (layer.attn, layer.mlp)]

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None, return_routing: bool = False,
                segments: Segments | None = None):
        """Logits [B, T, V]; with ``return_routing`` also the fp32 routing weights of the 2L reads,
        each [B, T, S_t] (read t after write t; an empty list for the baseline).  ``segments``: the
        batch's document offsets (``Batch.segments`` on the model's device), read by attention
        ``flash`` only."""
        cfg = self.cfg
        T = input_ids.shape[1]
        if T > cfg.max_seq_len:
            raise ValueError(f"input length {T} exceeds max_seq_len={cfg.max_seq_len}")
        norm = functools.partial(rms_norm, eps=cfg.norm_eps)
        x = self.embed(input_ids)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if cfg.stream_dtype == "autocast":
            x = x.to(dtype)  # the residual stream in the autocast dtype (a no-op without autocast)
        attend = make_attention(doc_ids, seq_len=T, device=x.device, dtype=dtype, backend=cfg.attention,
                                segments=segments)
        sub_args = (self.rope_cos[:T], self.rope_sin[:T], attend)

        subs = self.sublayers()
        ckpt = self.activation_checkpointing and torch.is_grad_enabled() and not return_routing

        if cfg.method == "baseline":
            def layer(i, h):
                for sub in subs[2 * i:2 * i + 2]:
                    h = h + sub(norm(h), *sub_args)[0]
                return h

            h = x
            for i in range(cfg.n_layers):
                h = _checkpointed(layer, i, h) if ckpt else layer(i, h)
            logits = self.head(norm(h))
            return (logits, []) if return_routing else logits

        n_writes = 2 * cfg.n_layers
        values = SourceBank(x, n_writes, cfg.blocks)
        keys = SourceBank(self.embed_route_key(x), n_writes, cfg.blocks) if cfg.method == "plr" else None
        fused = None if return_routing or keys is not None else self._fused_router(x.device)

        def write_and_read(t, h, values, keys):
            """Sub-layer t+1 writes, then the read after it: the next state h (and its weights)."""
            o, k = subs[t](norm(h), *sub_args)
            values.write(o.to(x.dtype))  # under autocast: every source in the stream's dtype
            query = self.queries[t]
            if keys is not None:
                keys.write(k)
                return route_keys(values.sources(), keys.sources(), query, eps=cfg.norm_eps, return_weights=return_routing)
            if fused is not None:
                return fused(values.sources(), query, norm=KEY_NORM[cfg.method], eps=cfg.norm_eps)
            return route(values.sources(), query, norm=KEY_NORM[cfg.method], eps=cfg.norm_eps, return_weights=return_routing)

        def layer(i, h, vstate, kstate):
            """Layer i's two writes and reads as a function of tensors (the banks' states in and out)."""
            vb = SourceBank(x, n_writes, cfg.blocks).resume(*vstate)
            kb = None if kstate is None else SourceBank(x, n_writes, cfg.blocks).resume(*kstate)
            for t in (2 * i, 2 * i + 1):
                h = write_and_read(t, h, vb, kb)
            return h, vb.state(), None if kb is None else kb.state()

        h, routing = x, []
        for i in range(cfg.n_layers):
            if ckpt:
                h, vstate, kstate = _checkpointed(layer, i, h, values.state(), None if keys is None else keys.state())
                values.resume(*vstate)
                if keys is not None:
                    keys.resume(*kstate)
                continue
            for t in (2 * i, 2 * i + 1):
                out = write_and_read(t, h, values, keys)
                if return_routing:
                    h, weights = out
                    routing.append(weights.movedim(0, -1))
                else:
                    h = out
        logits = self.head(norm(h))
        return (logits, routing) if return_routing else logits

    def _fused_router(self, device: torch.device):
        """``kernels.attnres`` if the config's router asks for it on this device, else None."""
        router = self.cfg.router
        if router == "reference" or (router == "auto" and device.type != "cuda"):
            return None
        kernels = _kernels()
        if kernels is None and router == "fused":
            raise ValueError("ModelConfig.router='fused' needs the 'kernels' package, which does not import")
        return None if kernels is None else kernels.attnres
