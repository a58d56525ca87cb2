"""The documents of a batch as flash-attn's varlen bookkeeping, built on the host.

A batch packs documents into rows (``doc_ids`` [B, T]: contiguous runs of equal ids, a row start
always opening a document).  flash-attn's varlen kernel reads them as ``cu_seqlens`` (int32
[n_docs + 1]: the offset of every document start in the B*T flattened tokens, then B*T) and the
longest document, a Python int.  Computing either from a device tensor inside the forward would
make the host wait for the device (``nonzero``, ``int(max())``), so the data loader computes both
once per batch from its host copy of ``doc_ids`` (``lrattnres.data.loader``) and the forward only
moves ``cu_seqlens`` to the device.  Its own module (torch only) so that the data stage and the
model share it without either importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """flash-attn's varlen bookkeeping of one batch: the documents of the rows, flattened to B*T tokens.

    ``cu_seqlens``: int32 [n_docs + 1], the offset of every document start in the flattened batch, then
    B*T; ``max_seqlen``: the longest document (a Python int, known on the host).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int

    def to(self, device, non_blocking: bool = False) -> "Segments":
        return Segments(self.cu_seqlens.to(device, non_blocking=non_blocking), self.max_seqlen)


def document_segments(doc_ids: torch.Tensor) -> Segments:
    """The ``Segments`` of a batch's ``doc_ids`` [B, T], computed on the host (the data loader calls it
    once per batch).  A row start always opens a document; so does every change of id."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be [B, T], got shape {tuple(doc_ids.shape)}")
    if doc_ids.device.type != "cpu":
        raise ValueError("document_segments runs on the host: pass the CPU doc_ids of the batch (the data "
                         f"loader's), not a copy on {doc_ids.device} (reading it back would sync the device)")
    B, T = doc_ids.shape
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([B * T])]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if B * T else 0
    return Segments(cu, max_seqlen)
