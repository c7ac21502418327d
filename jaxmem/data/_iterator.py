"""The deterministic, resumable batch iterator. ``(position, seed)`` is all its state.

Samples are fixed windows of ``seq_len + 1`` tokens of a corpus. Each epoch visits every window once
in an order drawn from ``(seed, epoch)`` by Grain's ``MapDataset.shuffle`` (a random-access index
permutation, so no order is ever materialised); sample number ``n`` (counted from the start of
training) is window ``order(epoch = n // windows)[n % windows]``. A batch is ``batch_size``
consecutive sample numbers, so a resumed or re-planned run that keeps the global batch size consumes
every sample exactly once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem.data._corpus import Corpus, default_corpus

__all__ = ["ORDER", "Batch", "DataIterator", "make_data"]

# How sample numbers map to windows; a checkpoint records it, and a run refuses to resume across a
# change (exactly-once would silently break).
ORDER = "grain-index-shuffle-1"


@dataclasses.dataclass(frozen=True)
class Batch:
    """One global batch: ``tokens`` and next-token ``targets`` ``[batch, seq]`` (int32), and the sample
    number of every row (for exactly-once accounting)."""

    tokens: np.ndarray
    targets: np.ndarray
    sample_ids: np.ndarray

    def arrays(self) -> dict:
        """What the model takes: the batch dict of :func:`jaxmem.models.make_batch`."""
        return {"tokens": self.tokens, "targets": self.targets}


@functools.lru_cache(maxsize=32)
def _window_order(num_windows: int, seed: int):
    import grain

    # Grain seeds epoch e with seed + e; spread user seeds apart so seed s + 1 is not seed s one
    # epoch later.
    grain_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    return grain.MapDataset.range(num_windows).shuffle(seed=grain_seed).repeat()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataIterator:
    """A deterministic, resumable stream of batches.

    Attributes:
        source: ``"text"`` (the embedded corpus, byte-level), ``"synthetic"`` (uniform random tokens),
            or a :class:`~jaxmem.data.Corpus` (from :func:`~jaxmem.data.load_corpus`).
        batch_size: rows per batch.
        seq_len: tokens per row.
        seed: fixes the sample order.
        position: samples consumed so far (the next batch starts at this sample number).
        vocab_size: the model's vocabulary: the token range of synthetic data, and a check that it
            holds every id of the corpus.

    >>> it = DataIterator(source="text", batch_size=2, seq_len=8, seed=0)
    >>> batch, it = it.next()
    >>> batch.tokens.shape, it.position
    ((2, 8), 2)
    """

    source: str | Corpus = "text"
    batch_size: int
    seq_len: int
    seed: int = 0
    position: int = 0
    vocab_size: int = 256

    def __post_init__(self):
        if isinstance(self.source, str) and self.source not in ("text", "synthetic"):
            raise JaxmemError(f"unknown data source {self.source!r}; use 'text', 'synthetic' or a Corpus")
        if self.batch_size < 1 or self.seq_len < 1:
            raise JaxmemError(f"batch size ({self.batch_size}) and sequence length ({self.seq_len}) must be >= 1")
        corpus = self.corpus
        if corpus is not None:
            if self.vocab_size < corpus.tokenizer.vocab_size:
                raise JaxmemError(
                    f"the data's tokenizer ({corpus.tokenizer.name}) has {corpus.tokenizer.vocab_size} ids but the "
                    f"model's vocabulary is {self.vocab_size}; use a model with vocab_size >= "
                    f"{corpus.tokenizer.vocab_size}"
                )
            if self.num_windows < 1:
                raise JaxmemError(
                    f"sequence length {self.seq_len} is longer than the corpus {corpus.name} ({len(corpus)} tokens)"
                )
            if self.batch_size > self.num_windows:
                raise JaxmemError(
                    f"a batch of {self.batch_size:,} sequences is more than the corpus {corpus.name} holds: "
                    f"{len(corpus):,} tokens make {self.num_windows:,} windows of {self.seq_len} + 1 tokens, and a "
                    "step would take some of them twice. Give a smaller batch size or sequence length, or more data"
                )
        # A global batch is built on the host, tokens and targets of int32: refuse one the host cannot hold.
        host_bytes = 2 * 4 * self.batch_size * self.seq_len
        limit = _physical_memory() // 2
        if limit and host_bytes > limit:
            raise JaxmemError(
                f"a batch of {self.batch_size:,} x {self.seq_len:,} tokens takes {host_bytes / 2**30:,.1f} GiB on the "
                f"host (tokens and targets, int32), more than half of this machine's memory "
                f"({2 * limit / 2**30:,.1f} GiB); give a smaller batch size"
            )

    @property
    def corpus(self) -> Corpus | None:
        if isinstance(self.source, Corpus):
            return self.source
        return default_corpus() if self.source == "text" else None

    @property
    def num_windows(self) -> int:
        """Samples per epoch."""
        corpus = self.corpus
        return (len(corpus) - 1) // (self.seq_len + 1) if corpus is not None else 2**31

    def window_of(self, sample_id: int) -> int:
        """Which window sample number ``sample_id`` reads."""
        return int(_window_order(self.num_windows, self.seed)[int(sample_id)])

    def sample(self, sample_id: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of one sample number."""
        corpus = self.corpus
        if corpus is None:
            rng = np.random.default_rng([self.seed, sample_id])
            return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)
        start = self.window_of(sample_id) * (self.seq_len + 1)
        return np.asarray(corpus.tokens[start : start + self.seq_len + 1], np.int32)

    def batch_at(self, position: int) -> Batch:
        ids = np.arange(position, position + self.batch_size, dtype=np.int64)
        window = np.stack([self.sample(int(i)) for i in ids])
        return Batch(tokens=window[:, :-1], targets=window[:, 1:], sample_ids=ids)

    def next(self) -> tuple[Batch, DataIterator]:
        """The next batch and the iterator advanced past it."""
        return self.batch_at(self.position), dataclasses.replace(self, position=self.position + self.batch_size)

    def state(self) -> dict:
        """What a checkpoint records: the position and seed, and the corpus fingerprint (a resumed run
        refuses data that changed)."""
        corpus = self.corpus
        state = {"position": self.position, "seed": self.seed, "order": ORDER}
        if corpus is not None and corpus is not default_corpus():
            state["fingerprint"] = corpus.fingerprint
        return state


def make_data(source, *, batch_size: int, seq_len: int, seed: int = 0, vocab_size: int = 256) -> DataIterator:
    return DataIterator(source=source, batch_size=batch_size, seq_len=seq_len, seed=seed, vocab_size=vocab_size)


def _physical_memory() -> int:
    """Bytes of this machine's memory (0 where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
