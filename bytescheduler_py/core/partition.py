"""Partition: split a flat tensor into contiguous element ranges of bounded byte size."""

from __future__ import annotations

from typing import List, Tuple


def partition_ranges(numel: int, itemsize: int, partition_bytes: int) -> List[Tuple[int, int]]:
    """Split ``numel`` elements of ``itemsize`` bytes into ranges of at most ``partition_bytes``.

    Every range holds at least one element, so an element larger than the partition
    size still goes out (alone). Ranges are contiguous and cover ``[0, numel)``.

    >>> partition_ranges(10, 4, 16)
    [(0, 4), (4, 8), (8, 10)]
    >>> partition_ranges(0, 4, 16)
    []
    """
    if numel <= 0:
        return []
    if numel * itemsize <= partition_bytes:
        return [(0, numel)]
    step = max(1, partition_bytes // itemsize)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]
