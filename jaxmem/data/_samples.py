"""Samples of a model with a batch of its own (a classifier's images and labels, anything but the
language models' token windows): random access by index, batched and shuffled as the token data
is.

Sample number ``n`` (counted from the start of training) reads index ``order(epoch = n // N)[n % N]``
of the ``N`` samples, the order drawn from ``(seed, epoch)`` by the same Grain index shuffle as the
token windows (:mod:`jaxmem.data._iterator`); a batch is ``batch_size`` consecutive sample numbers,
so a resumed run consumes every sample exactly once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem.data._iterator import ORDER, _window_order

__all__ = ["SampleBatch", "SampleIterator", "Samples", "load_samples"]


class Samples:
    """A model's training (or held-out) samples, each a dict of arrays.

    Args:
        source: a dict of arrays that lead with the sample axis (``{"images": [N, 32, 32, 3],
            "labels": [N]}``), or any random-access sequence of sample dicts -- ``len()`` and
            ``[i]``: a list, a Grain ``MapDataset``, a Hugging Face ``datasets.Dataset`` in numpy
            format. Every sample has the keys, shapes and dtypes of the first.
        name: shown in reports; recorded in checkpoints with the samples' fingerprint.

    >>> data = Samples({"x": np.zeros((10, 3), np.float32), "y": np.arange(10)}, name="toy")
    >>> len(data), data.spec(4)["x"].shape
    (10, (4, 3))
    """

    def __init__(self, source, *, name: str = "samples", _range: tuple[int, int] | None = None):
        if isinstance(source, Mapping):
            arrays = {k: np.asarray(v) for k, v in source.items()}
            lengths = {k: (a.shape[0] if a.ndim else None) for k, a in arrays.items()}
            if not arrays or len(set(lengths.values())) != 1 or None in lengths.values():
                raise JaxmemError(
                    f"samples {name!r}: a dict of arrays must lead every array with the same number of samples; "
                    f"got leading sizes {lengths}"
                )
            source = arrays
            size = next(iter(lengths.values()))
        else:
            if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
                raise JaxmemError(
                    f"samples {name!r}: give a dict of arrays or a random-access sequence of sample dicts (len() and "
                    f"[i]), got {type(source).__name__}"
                )
            size = len(source)
        self.source = source
        self.name = name
        self._range = _range or (0, size)
        if len(self) < 1:
            raise JaxmemError(f"samples {name!r} hold no sample")
        first = self._raw(0)
        if not isinstance(first, Mapping) or not first:
            raise JaxmemError(f"samples {name!r}: a sample is a dict of arrays, got {type(first).__name__}")
        self._shapes = {k: (np.asarray(v).shape, np.asarray(v).dtype) for k, v in first.items()}

    def __len__(self) -> int:
        return self._range[1] - self._range[0]

    def _raw(self, index: int):
        i = self._range[0] + int(index)
        if isinstance(self.source, dict):
            return {k: a[i] for k, a in self.source.items()}
        return self.source[i]

    def sample(self, index: int) -> dict:
        """Sample ``index`` as NumPy arrays, checked against the first sample's keys, shapes, dtypes."""
        got = {k: np.asarray(v) for k, v in self._raw(index).items()}
        shapes = {k: (v.shape, v.dtype) for k, v in got.items()}
        if shapes != self._shapes:
            raise JaxmemError(
                f"samples {self.name!r}: sample {index} is {_describe(shapes)}, sample 0 {_describe(self._shapes)}; "
                "every sample must have the same keys, shapes and dtypes (pad or crop them)"
            )
        return got

    def spec(self, batch_size: int) -> dict:
        """A batch of ``batch_size`` samples, abstract."""
        import jax

        return {k: jax.ShapeDtypeStruct((batch_size, *shape), dtype) for k, (shape, dtype) in self._shapes.items()}

    @property
    def fingerprint(self) -> str:
        """Identifies the samples in a checkpoint: their name, number, spec and the bytes of the first
        and last (a resumed run refuses other data)."""
        h = hashlib.sha256(f"{self.name}|{len(self)}|{_describe(self._shapes)}".encode())
        for index in (0, len(self) - 1):
            for key, value in sorted(self.sample(index).items()):
                h.update(key.encode())
                h.update(np.ascontiguousarray(value).tobytes())
        return f"{self.name}:{len(self)}:{h.hexdigest()[:16]}"

    def split(self, fraction: float) -> tuple[Samples, Samples | None]:
        """``(train, held out)``: the last ``fraction`` of the samples held out (None when none are)."""
        held = int(round(len(self) * fraction)) if fraction else 0
        if held == 0:
            return self, None
        if held >= len(self):
            raise JaxmemError(
                f"samples {self.name!r}: holding out {fraction:g} of {len(self)} samples leaves none to train on"
            )
        start, stop = self._range
        train = Samples(self.source, name=self.name, _range=(start, stop - held))
        return train, Samples(self.source, name=f"{self.name} (held out)", _range=(stop - held, stop))


def load_samples(text: str) -> Samples:
    """The :class:`Samples` ``package.module:attr`` names (or a function it names returns)."""
    from jaxmem._util import call_factory, import_named

    obj = import_named(text, "samples", "mydata:train")
    if not isinstance(obj, Samples):
        obj = call_factory(obj, text, "samples", "a jaxmem.data.Samples")
    if not isinstance(obj, Samples):
        raise JaxmemError(
            f"samples {text!r} is a {type(obj).__name__}; name a jaxmem.data.Samples or a function returning one "
            "(e.g. Samples({'images': images, 'labels': labels}))"
        )
    return obj


def _describe(shapes: dict) -> str:
    return "{" + ", ".join(f"{k}: {np.dtype(d).name}{list(s)}" for k, (s, d) in sorted(shapes.items())) + "}"


@dataclasses.dataclass(frozen=True)
class SampleBatch:
    """One global batch of :class:`Samples`: its arrays (``[batch, ...]`` each) and the sample number
    of every row (for exactly-once accounting)."""

    values: dict
    sample_ids: np.ndarray

    def arrays(self) -> dict:
        """What the model takes: its own batch dict."""
        return dict(self.values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleIterator:
    """A deterministic, resumable stream of batches of :class:`Samples` (the interface of
    :class:`~jaxmem.data.DataIterator`): ``(position, seed)`` is all its state."""

    source: Samples
    batch_size: int
    seed: int = 0
    position: int = 0

    def __post_init__(self):
        if self.batch_size < 1:
            raise JaxmemError(f"batch size ({self.batch_size}) must be >= 1")

    def index_of(self, sample_id: int) -> int:
        """Which sample sample number ``sample_id`` reads."""
        return int(_window_order(len(self.source), self.seed)[int(sample_id)])

    def batch_at(self, position: int) -> SampleBatch:
        ids = np.arange(position, position + self.batch_size, dtype=np.int64)
        rows = [self.source.sample(self.index_of(int(i))) for i in ids]
        return SampleBatch({k: np.stack([r[k] for r in rows]) for k in rows[0]}, ids)

    def next(self) -> tuple[SampleBatch, SampleIterator]:
        """The next batch and the iterator advanced past it."""
        return self.batch_at(self.position), dataclasses.replace(self, position=self.position + self.batch_size)

    def state(self) -> dict:
        """What a checkpoint records: the position and seed, and the samples' fingerprint."""
        return {"position": self.position, "seed": self.seed, "order": ORDER, "fingerprint": self.source.fingerprint}
