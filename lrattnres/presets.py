"""Named model shapes.

The paper's shapes (Sections 4.1 and 4.5) and the small shapes of the CPU and single-GPU scales.
A preset fixes the backbone only; the routing variant (method, blocks, rank) is chosen per run.
Every SwiGLU width keeps the paper's ratio m/d = 2816/1024 = 2.75.

``vocab_size: None`` means "take it from the data manifest": the small scales train on a compacted
vocabulary, so the caller passes ``vocab_size`` next to the preset name.

This module does not import torch, so cheap stages (accounting, config) can read shapes from it.
"""

from __future__ import annotations

PAPER_VOCAB = 100_277  # cl100k_base n_vocab

PRESETS: dict[str, dict] = {
    # the paper
    "0.5B": dict(n_layers=24, d_model=1024, n_heads=16, d_ff=2816, max_seq_len=2048, vocab_size=PAPER_VOCAB),
    "1B": dict(n_layers=24, d_model=1536, n_heads=24, d_ff=4224, max_seq_len=2048, vocab_size=PAPER_VOCAB),
    "4B": dict(n_layers=44, d_model=2560, n_heads=40, d_ff=7040, max_seq_len=2048, vocab_size=PAPER_VOCAB),
    # CPU scales (smoke: every rule runs; tiny and tiny-large: the size pair standing in for 1B/4B)
    "smoke": dict(n_layers=2, d_model=32, n_heads=2, d_ff=88, max_seq_len=64, vocab_size=None),
    "tiny": dict(n_layers=4, d_model=64, n_heads=4, d_ff=176, max_seq_len=128, vocab_size=None),
    "tiny-large": dict(n_layers=6, d_model=96, n_heads=6, d_ff=264, max_seq_len=128, vocab_size=None),
    # one-GPU scale (head width 64 like the paper's models)
    "gpu-small": dict(n_layers=8, d_model=384, n_heads=6, d_ff=1056, max_seq_len=1024, vocab_size=None),
    "gpu-large": dict(n_layers=12, d_model=512, n_heads=8, d_ff=1408, max_seq_len=1024, vocab_size=None),
}


def get_preset(name: str) -> dict:
    """A copy of preset ``name``'s fields; unknown names raise ValueError listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return dict(PRESETS[name])
