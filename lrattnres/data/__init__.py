"""Data stage: offline cl100k tokenizer, document sources, token shards, manifest and loaders.

See docs/contracts.md (Data). Public names::

    load_manifest(path, verify=True) -> dict         load_tokenizer(m) -> Tokenizer
    TokenLoader(manifest, split, batch_size, seq_len, seed, rank=0, world_size=1)
    iter_eval_batches(manifest, split, batch_size, seq_len) -> EvalBatches (.tokens_covered)
    prepare(spec, out) -> manifest                    python -m lrattnres.data.cli --spec JSON --out DIR
"""

from .loader import Batch, EvalBatches, TokenLoader, iter_eval_batches
from .manifest import ManifestError, doc_ends, load_manifest, load_tokenizer, load_vocab_ids, manifest_sha256
from .shards import prepare
from .spec import DEFAULTS, SpecError, validate_spec
from .tokenizer import EOT, N_VOCAB, Tokenizer, get_encoding

__all__ = [
    "Batch", "EvalBatches", "TokenLoader", "iter_eval_batches",
    "ManifestError", "doc_ends", "load_manifest", "load_tokenizer", "load_vocab_ids", "manifest_sha256",
    "prepare", "DEFAULTS", "SpecError", "validate_spec",
    "EOT", "N_VOCAB", "Tokenizer", "get_encoding",
]
