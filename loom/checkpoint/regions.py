"""Geometry of regions: intersecting boxes, cutting flat ranges into boxes, splitting shares.

Everything reduces to boxes. A flat range ``[a, b)`` of a row-major tensor is a union of at
most ``2·ndim - 1`` boxes, each *contiguous* in flat order (leading dims of length 1, one
dim with a range, trailing dims full), so a stored flat piece can be viewed as those boxes
without copying. Copying between any two regions is then box ∩ box.
"""

from __future__ import annotations

import torch

from loom.checkpoint.protocol import Box, Flat, Region


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None if empty."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return Box(tuple(offs), tuple(lens))


def flat_to_boxes(start: int, length: int, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """Cut flat range ``[start, start+length)`` into contiguous boxes: ``[(offset_in_range, box)]``."""
    if length <= 0:
        return []
    if not shape:  # a scalar
        return [(0, Box((), ()))]
    boxes: list[Box] = []

    def rec(a: int, b: int, k: int) -> None:
        # [a, b) lies in the sub-tensor at index ``prefix`` (k leading dims fixed); recorded
        # boxes carry the prefix in their offsets, so only dims k.. are decided here.
        if a >= b:
            return
        dims = shape[k:]
        inner = 1
        for d in dims[1:]:
            inner *= d
        ra, rb = a // inner, b // inner
        if ra == rb:
            prefix.append(ra)
            rec(a - ra * inner, b - ra * inner, k + 1)
            prefix.pop()
            return
        if a % inner:
            prefix.append(ra)
            rec(a % inner, inner, k + 1)
            prefix.pop()
            ra += 1
        if rb > ra:
            offs = (*prefix, ra, *(0 for _ in dims[1:]))
            boxes.append(Box(offs, (*(1 for _ in prefix), rb - ra, *dims[1:])))
        if b % inner:
            prefix.append(rb)
            rec(0, b % inner, k + 1)
            prefix.pop()

    prefix: list[int] = []
    rec(start, start + length, 0)
    strides = _strides(shape)
    out = [(sum(o * s for o, s in zip(b.offsets, strides)) - start, b) for b in boxes]
    out.sort(key=lambda x: x[0])
    return out


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, s = [], 1
    for d in reversed(shape):
        strides.append(s)
        s *= d
    return strides[::-1]


def region_boxes(region: Region, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """Boxes covering ``region`` of a tensor of ``shape``, with their flat offset inside it.

    For a Box region the single offset is 0 and the stored tensor already has the box shape.
    """
    if isinstance(region, Box):
        return [(0, region)] if region.numel > 0 or not shape else []
    if region.within is None:
        return flat_to_boxes(region.start, region.length, shape)
    base = region.within
    return [
        (off, Box(tuple(o + b for o, b in zip(box.offsets, base.offsets)), box.lengths))
        for off, box in flat_to_boxes(region.start, region.length, base.lengths)
    ]


def view_box(stored: torch.Tensor, region: Region, offset: int, box: Box) -> torch.Tensor:
    """The part of ``stored`` (the data of ``region``) that holds ``box`` (from region_boxes)."""
    if isinstance(region, Box):
        return stored
    return stored.reshape(-1)[offset : offset + box.numel].view(box.lengths)


def local_slices(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Slices selecting ``inner`` (a sub-box in global coords) from a tensor holding ``outer``."""
    return tuple(slice(i - o, i - o + n) for i, o, n in zip(inner.offsets, outer.offsets, inner.lengths))


def copy_region(dst: torch.Tensor, dst_region: Region, src: torch.Tensor, src_region: Region, shape) -> int:
    """Copy the overlap of two stored regions of one global tensor; return elements copied."""
    copied = 0
    src_boxes = region_boxes(src_region, shape)
    for doff, dbox in region_boxes(dst_region, shape):
        dview = view_box(dst, dst_region, doff, dbox)
        for soff, sbox in src_boxes:
            common = intersect(dbox, sbox) if shape else dbox
            if common is None:
                continue
            sview = view_box(src, src_region, soff, sbox)
            dview[local_slices(dbox, common)].copy_(sview[local_slices(sbox, common)])
            copied += common.numel
    return copied


def share(region: Region, shape: tuple[int, ...], index: int, count: int) -> Region | None:
    """Part ``index`` of ``count`` near-equal parts of ``region`` (first dim, or flat range).

    Replicas of a piece write one share each. Returns None for an empty share.
    """
    if count == 1:
        return region
    if isinstance(region, Flat):
        a = region.start + region.length * index // count
        b = region.start + region.length * (index + 1) // count
        return Flat(a, b - a, region.within) if b > a else None
    if not shape:
        return region if index == 0 else None
    n0 = region.lengths[0]
    a, b = n0 * index // count, n0 * (index + 1) // count
    if b <= a:
        return None
    return Box((region.offsets[0] + a, *region.offsets[1:]), (b - a, *region.lengths[1:]))


def take(local: torch.Tensor, region: Region, part: Region) -> torch.Tensor:
    """The data of ``part`` (a share of ``region``, as returned by :func:`share`) inside ``local``."""
    if isinstance(region, Flat):
        if not isinstance(part, Flat):
            raise TypeError(f"take: part {part} of the flat region {region} must be flat too")
        return local.reshape(-1)[part.start - region.start : part.start - region.start + part.length]
    if not region.offsets:
        return local
    if not isinstance(part, Box):
        raise TypeError(f"take: part {part} of the box {region} must be a box too")
    a = part.offsets[0] - region.offsets[0]
    return local[a : a + part.lengths[0]]


def overlaps(a: Region, b: Region, shape: tuple[int, ...]) -> bool:
    """True if two regions of the same tensor share an element."""
    if isinstance(a, Flat) and isinstance(b, Flat) and a.within == b.within:
        return max(a.start, b.start) < min(a.start + a.length, b.start + b.length)
    if not shape:
        return a.numel > 0 and b.numel > 0
    return any(
        intersect(x, y) is not None for _, x in region_boxes(a, shape) for _, y in region_boxes(b, shape)
    )


def row_span(region: Region, shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of dim 0 that ``region`` touches ((0, 1) for a scalar): regions with
    disjoint spans share no element, so one comparison rules a stored piece out."""
    if not shape:
        return 0, 1
    if isinstance(region, Box):
        return region.offsets[0], region.offsets[0] + region.lengths[0]
    base = region.within.lengths if region.within is not None else shape
    first = region.within.offsets[0] if region.within is not None else 0
    inner = 1
    for d in base[1:]:
        inner *= d
    if region.length == 0 or inner == 0:
        return first, first
    return first + region.start // inner, first + (region.start + region.length - 1) // inner + 1
