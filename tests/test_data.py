"""The embedded corpus and its deterministic, resumable iterator."""

import numpy as np
import pytest

from jaxmem import JaxmemError
from jaxmem.data import DataIterator, corpus_bytes


def test_corpus_is_embedded_and_large():
    data = corpus_bytes()
    assert data.dtype == np.uint8 and len(data) > 400_000


def test_batches_are_deterministic_and_resumable():
    it = DataIterator(batch_size=4, seq_len=32, seed=7)
    batches = []
    for _ in range(3):
        b, it = it.next()
        batches.append(b)
    resumed = DataIterator(batch_size=4, seq_len=32, seed=7, position=8)
    again, _ = resumed.next()
    np.testing.assert_array_equal(again.tokens, batches[2].tokens)
    np.testing.assert_array_equal(batches[0].targets[:, :-1], batches[0].tokens[:, 1:])
    assert list(batches[1].sample_ids) == [4, 5, 6, 7]


def test_an_epoch_visits_every_window_once():
    it = DataIterator(batch_size=1, seq_len=4000, seed=1)
    n = it.num_windows
    seen = {tuple(it.batch_at(i).tokens[0, :16]) for i in range(n)}
    assert len(seen) == n


def test_synthetic_tokens_respect_the_vocabulary():
    b = DataIterator(source="synthetic", batch_size=3, seq_len=8, vocab_size=50).batch_at(0)
    assert b.tokens.max() < 50 and b.tokens.shape == (3, 8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(source="web", batch_size=1, seq_len=8), "unknown data source"),
        (dict(batch_size=0, seq_len=8), "must be >= 1"),
        (dict(batch_size=1, seq_len=8, vocab_size=100), "has 256 ids but the model.s vocabulary is 100"),
    ],
)
def test_bad_data_settings(kwargs, message):
    with pytest.raises(JaxmemError, match=message):
        DataIterator(**kwargs)
