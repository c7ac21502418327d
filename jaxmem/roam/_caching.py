"""A simulation of a PyTorch-like caching allocator, for the "eager framework" baseline.

Our model of PyTorch's CUDACachingAllocator (documented defaults, simplified):
- sizes round up to multiples of 512 bytes;
- requests up to 1 MiB come from a small pool of 2 MiB segments; larger ones from a large pool whose
  segments are 20 MiB for requests under 10 MiB, otherwise the request rounded up to 2 MiB;
- a request takes the best-fitting free block of its pool (smallest that fits, lowest address on
  ties), split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  with no block free, a new segment is reserved;
- a freed block merges with free neighbours in its segment; segments are never returned (no
  ``empty_cache``), and nothing is compacted.
The figure is the peak of reserved bytes (what the device must have).
"""

from __future__ import annotations

import bisect
import dataclasses

__all__ = ["CachingAllocator", "simulate_caching_allocator"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def _round(size: int) -> int:
    return max(MIN_BLOCK, (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


@dataclasses.dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool


class CachingAllocator:
    def __init__(self):
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0
        self.segments: list[list[_Block]] = []  # blocks in address order per segment
        self.segment_small: list[bool] = []
        self.free_blocks = {True: [], False: []}  # pool (small?) -> sorted list of (size, segment, offset)
        self.where = {}

    def _pool(self, size: int) -> bool:
        return size <= SMALL_SIZE

    def malloc(self, key, size: int) -> None:
        size = _round(size)
        small = self._pool(size)
        pool = self.free_blocks[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            bsize, seg, off = pool.pop(i)
            block = next(b for b in self.segments[seg] if b.offset == off)
        else:
            seg_size = (
                SMALL_BUFFER
                if small
                else (LARGE_BUFFER if size < MIN_LARGE_ALLOC else (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE)
            )
            seg = len(self.segments)
            block = _Block(seg, 0, seg_size, True)
            self.segments.append([block])
            self.segment_small.append(small)
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE):
            tail = _Block(block.segment, block.offset + size, rest, True)
            blocks = self.segments[block.segment]
            blocks.insert(blocks.index(block) + 1, tail)
            bisect.insort(pool, (tail.size, tail.segment, tail.offset))
            block.size = size
        block.free = False
        self.allocated += block.size
        self.where[key] = block

    def free(self, key) -> None:
        block = self.where.pop(key)
        self.allocated -= block.size
        block.free = True
        pool = self.free_blocks[self.segment_small[block.segment]]
        blocks = self.segments[block.segment]
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:  # merge with the free right neighbour
            right = blocks.pop(i + 1)
            pool.remove((right.size, right.segment, right.offset))
            block.size += right.size
        if i > 0 and blocks[i - 1].free:  # and with the free left neighbour
            left = blocks[i - 1]
            pool.remove((left.size, left.segment, left.offset))
            left.size += block.size
            blocks.pop(i)
            block = left
        bisect.insort(pool, (block.size, block.segment, block.offset))


def simulate_caching_allocator(graph, order) -> int:
    """Peak reserved bytes when ``order`` runs eagerly on a caching allocator (inputs allocated first)."""
    from jaxmem.roam._liveness import lifetimes

    intervals = lifetimes(graph, order)
    alloc = CachingAllocator()
    frees_at: dict[int, list[int]] = {}
    for t, (_, last) in intervals.items():
        frees_at.setdefault(last, []).append(t)
    for t in graph.inputs:
        if t in intervals:
            alloc.malloc(t, graph.sizes[t])
    for step, op_index in enumerate(order):
        op = graph.ops[op_index]
        if op.transient:
            alloc.malloc(("transient", step), op.transient)
        for t in op.outputs:
            if t in intervals:
                alloc.malloc(t, graph.sizes[t])
        if op.transient:
            alloc.free(("transient", step))
        for t in frees_at.get(step, []):
            if t in alloc.where:
                alloc.free(t)
    return alloc.peak_reserved
