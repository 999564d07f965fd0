"""The byte layout of a held copy: what a holder keeps in host memory and a recovering
sink pulls from it, bucket by bucket."""

from __future__ import annotations

import torch

from weightsync.transfer.broadcast import host_crc32
from weightsync.transfer.layout import Bucket, BucketLayout


def held_offsets(layout: BucketLayout) -> list[int]:
    """Where each bucket starts in a held version: the buckets back to back, in order."""
    offsets: list[int] = []
    at = 0
    for bucket in layout.buckets:
        offsets.append(at)
        at += bucket.nbytes
    return offsets


def held_checksum(region: torch.Tensor, bucket: Bucket) -> int:
    """CRC-32 of a bucket's tensor bytes in `region` (host memory laid out like the
    bucket), in order. The alignment padding between tensors is left out: a holder that
    copies slots keeps whatever the source's slot held there, one that copies the
    published tensors keeps its own buffer's bytes, and both must agree."""
    data = region.view(torch.uint8)
    crc = 0
    for t in bucket.tensors:
        if t.offset + t.nbytes > data.numel():
            raise ValueError(f"tensor {t.name!r} lies outside the region")
        crc = host_crc32(data[t.offset : t.offset + t.nbytes], crc)
    return crc
