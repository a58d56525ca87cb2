"""Training: optimisers (Muon/AdamW), schedule, checkpoints, metrics, validation and the loop.

``python -m lrattnres train --spec '<json>' --data <manifest.json> --out <run dir>``; see
``lrattnres.train.cli`` for exit codes and ``lrattnres.train.spec`` for the keys.
"""
