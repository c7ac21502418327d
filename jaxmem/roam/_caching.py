"""A simulation of a PyTorch-like caching allocator, for the "eager framework" baseline.

Our model of PyTorch's CUDACachingAllocator (documented defaults, simplified):
- sizes round up to multiples of 512 bytes;
- requests up to 1 MiB come from a small pool of 2 MiB segments; larger ones from a large pool whose
  segments are 20 MiB for requests under 10 MiB, otherwise the request rounded up to 2 MiB;
- a request takes the best-fitting free block of its pool (smallest that fits, lowest address on
  ties), split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  with no block free, a new segment is reserved;
- a freed block merges with free neighbours in its segment; nothing is compacted;
- with a ``capacity`` (the device's memory), a request that needs a new segment beyond it first
  returns every wholly free cached segment to the device and retries (as PyTorch frees its cached
  blocks before it reports out of memory); only then is it out of memory.
Reported: the peak of allocated bytes (blocks in use, rounded) and of reserved bytes (segments held);
:func:`caching_allocator_capacity` finds the smallest device on which an order runs at all.
"""

from __future__ import annotations

import bisect
import dataclasses

__all__ = [
    "CachingAllocator",
    "CachingRun",
    "OutOfMemory",
    "caching_allocator_capacity",
    "run_caching_allocator",
    "simulate_caching_allocator",
]

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


class OutOfMemory(Exception):
    """A request the allocator cannot serve within its capacity, even after releasing its cache."""


class CachingAllocator:
    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.releases = 0  # times the cache was emptied to serve a request
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
            if self.capacity is not None and self.reserved + seg_size > self.capacity:
                self._release_cached()
                if self.reserved + seg_size > self.capacity:
                    raise OutOfMemory(f"{size} bytes: {self.reserved} reserved of {self.capacity}")
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
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.where[key] = block

    def _release_cached(self) -> None:
        """Return every segment with no block in use (PyTorch's ``release_cached_blocks``)."""
        for seg, blocks in enumerate(self.segments):
            if blocks and len(blocks) == 1 and blocks[0].free:
                block = blocks[0]
                self.free_blocks[self.segment_small[seg]].remove((block.size, seg, block.offset))
                self.reserved -= block.size
                blocks.clear()  # the index stays (segment ids are positions), empty
        self.releases += 1

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


@dataclasses.dataclass(frozen=True)
class CachingRun:
    allocated_peak: int  # bytes in blocks in use (sizes rounded to the allocator's granularity)
    reserved_peak: int  # bytes of segments held from the device
    releases: int  # times the cache was emptied to fit the capacity


def run_caching_allocator(graph, order, capacity: int | None = None) -> CachingRun:
    """Run ``order`` eagerly on the caching allocator (inputs allocated first; each op's outputs and
    transient allocated, then the transient and the tensors it was the last reader of freed).
    Raises :class:`OutOfMemory` when it does not fit ``capacity``."""
    from jaxmem.roam._liveness import lifetimes

    intervals = lifetimes(graph, order)
    alloc = CachingAllocator(capacity)
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
    return CachingRun(alloc.peak_allocated, alloc.peak_reserved, alloc.releases)


def simulate_caching_allocator(graph, order) -> int:
    """Peak reserved bytes when ``order`` runs eagerly on an unbounded caching allocator."""
    return run_caching_allocator(graph, order).reserved_peak


def caching_allocator_capacity(graph, order, granularity: int = ROUND_LARGE) -> int:
    """The smallest device (a multiple of ``granularity``) on which the caching allocator runs
    ``order``, releasing its cache when it must: what the eager framework needs, which can be less
    than its unbounded reserved peak."""
    unbounded = run_caching_allocator(graph, order)
    lo = max(unbounded.allocated_peak // granularity - 1, 0)  # fails: below what is in use
    hi = -(-unbounded.reserved_peak // granularity)  # runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            run_caching_allocator(graph, order, capacity=mid * granularity)
            hi = mid
        except OutOfMemory:
            lo = mid
    return hi * granularity
