"""Training data that needs no download: byte-level text from CPython's ``pydoc_data.topics``, or
synthetic tokens. Iterators are deterministic and resumable: ``(position, seed)`` is all their state.

Samples are fixed windows of ``seq_len + 1`` bytes. Each epoch visits every window once in an order
drawn from ``(seed, epoch)``; sample number ``n`` (counted from the start of training) is window
``order(epoch = n // windows)[n % windows]``. A batch is ``batch_size`` consecutive sample numbers, so
a resumed or re-planned run that keeps the global batch size consumes every sample exactly once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxmem._errors import JaxmemError

__all__ = ["Batch", "DataIterator", "corpus_bytes", "make_data"]


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> np.ndarray:
    """The default corpus: every entry of ``pydoc_data.topics``, in sorted key order, as UTF-8 bytes."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataIterator:
    """A deterministic, resumable stream of batches.

    Attributes:
        source: ``"text"`` (the embedded corpus) or ``"synthetic"`` (uniform random tokens).
        batch_size: rows per batch.
        seq_len: tokens per row.
        seed: fixes the sample order.
        position: samples consumed so far (the next batch starts at this sample number).
        vocab_size: token range for synthetic data (text is bytes: 256).

    >>> it = DataIterator(source="text", batch_size=2, seq_len=8, seed=0)
    >>> batch, it = it.next()
    >>> batch.tokens.shape, it.position
    ((2, 8), 2)
    """

    source: str = "text"
    batch_size: int
    seq_len: int
    seed: int = 0
    position: int = 0
    vocab_size: int = 256

    def __post_init__(self):
        if self.source not in ("text", "synthetic"):
            raise JaxmemError(f"unknown data source {self.source!r}; use 'text' or 'synthetic'")
        if self.batch_size < 1 or self.seq_len < 1:
            raise JaxmemError(f"batch size ({self.batch_size}) and sequence length ({self.seq_len}) must be >= 1")
        if self.source == "text":
            if self.vocab_size < 256:
                raise JaxmemError(f"text data is byte-level (256 tokens); the model's vocabulary is {self.vocab_size}")
            if self.num_windows < 1:
                raise JaxmemError(f"sequence length {self.seq_len} is longer than the corpus")

    @property
    def num_windows(self) -> int:
        return (len(corpus_bytes()) - 1) // (self.seq_len + 1) if self.source == "text" else 2**31

    def _window_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def sample(self, sample_id: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of one sample number."""
        if self.source == "synthetic":
            rng = np.random.default_rng([self.seed, sample_id])
            return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)
        epoch, index = divmod(sample_id, self.num_windows)
        window = self._window_order(epoch)[index]
        start = window * (self.seq_len + 1)
        return corpus_bytes()[start : start + self.seq_len + 1].astype(np.int32)

    def batch_at(self, position: int) -> Batch:
        ids = np.arange(position, position + self.batch_size, dtype=np.int64)
        if self.source == "text":
            # One permutation per epoch touched, not per sample.
            rows = []
            cache: dict[int, np.ndarray] = {}
            data = corpus_bytes()
            for sample_id in ids:
                epoch, index = divmod(int(sample_id), self.num_windows)
                if epoch not in cache:
                    cache[epoch] = self._window_order(epoch)
                start = int(cache[epoch][index]) * (self.seq_len + 1)
                rows.append(data[start : start + self.seq_len + 1])
            window = np.stack(rows).astype(np.int32)
        else:
            window = np.stack([self.sample(int(i)) for i in ids])
        return Batch(tokens=window[:, :-1], targets=window[:, 1:], sample_ids=ids)

    def next(self) -> tuple[Batch, DataIterator]:
        """The next batch and the iterator advanced past it."""
        return self.batch_at(self.position), dataclasses.replace(self, position=self.position + self.batch_size)

    def state(self) -> dict:
        return {"position": self.position, "seed": self.seed}


def make_data(source: str, *, batch_size: int, seq_len: int, seed: int = 0, vocab_size: int = 256) -> DataIterator:
    return DataIterator(source=source, batch_size=batch_size, seq_len=seq_len, seed=seed, vocab_size=vocab_size)
