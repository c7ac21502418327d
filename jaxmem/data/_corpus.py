"""Corpora: documents read from text files, JSONL or Parquet (or the embedded default), tokenized and
packed into one token stream. A corpus is a read-only array plus a fingerprint; the iterator cuts it
into windows."""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
from collections.abc import Iterator

import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem.data._tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = ["Corpus", "corpus_bytes", "default_corpus", "list_files", "load_corpus", "read_documents"]

_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> np.ndarray:
    """The default corpus: every entry of ``pydoc_data.topics``, in sorted key order, as UTF-8 bytes."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A packed token stream.

    Attributes:
        tokens: every document's ids, end to end (separated by the tokenizer's end-of-document id,
            or by a blank line for byte-level text).
        tokenizer: what made them.
        name: where they came from (for messages).
        documents: how many documents.
        fingerprint: a hash of the ids; a resumed run checks it, so changed data is never silently
            mixed into an exactly-once run.
    """

    tokens: np.ndarray
    tokenizer: Tokenizer
    name: str
    documents: int = 1
    fingerprint: str = ""

    def __post_init__(self):
        if not self.fingerprint:
            digest = hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes()).hexdigest()[:16]
            object.__setattr__(self, "fingerprint", f"{self.tokenizer.fingerprint()}-{digest}")

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, eval_fraction: float) -> tuple[Corpus, Corpus | None]:
        """``(train, eval)``: the last ``eval_fraction`` of the stream is held out (one contiguous piece,
        so no training window overlaps an eval window)."""
        if not eval_fraction:
            return self, None
        if not 0.0 < eval_fraction < 1.0:
            raise JaxmemError(f"--eval-fraction is in [0, 1), got {eval_fraction}")
        cut = int(len(self.tokens) * (1.0 - eval_fraction))
        part = functools.partial(Corpus, tokenizer=self.tokenizer, documents=self.documents)
        return (
            part(self.tokens[:cut], name=f"{self.name} (train)", fingerprint=f"{self.fingerprint}:train{cut}"),
            part(self.tokens[cut:], name=f"{self.name} (eval)", fingerprint=f"{self.fingerprint}:eval{cut}"),
        )


@functools.lru_cache(maxsize=1)
def default_corpus() -> Corpus:
    """The embedded corpus (CPython's pydoc topics), byte-level."""
    return Corpus(corpus_bytes().astype(np.int32), ByteTokenizer(), "pydoc topics", len(_pydoc_keys()))


def _pydoc_keys():
    from pydoc_data import topics

    return sorted(topics.topics)


def list_files(spec: str) -> list[str]:
    """The files a ``--data`` spec names, sorted: comma-separated paths, globs (``**`` recurses) or
    directories (every text, JSONL and Parquet file below them)."""
    files: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        part = os.path.expanduser(part)
        if os.path.isdir(part):
            found = [
                p
                for p in glob.glob(os.path.join(part, "**", "*"), recursive=True)
                if os.path.isfile(p) and p.lower().endswith(_TEXT_SUFFIXES + _JSON_SUFFIXES + _PARQUET_SUFFIXES)
            ]
            if not found:
                raise JaxmemError(
                    f"--data {part}: the directory holds no .txt, .md, .jsonl or .parquet files; name the files "
                    "(a glob such as 'data/*.log' reads any file as text)"
                )
        elif any(c in part for c in "*?["):
            found = [p for p in glob.glob(part, recursive=True) if os.path.isfile(p)]
            if not found:
                raise JaxmemError(f"--data {part}: no file matches")
        elif os.path.isfile(part):
            found = [part]
        else:
            raise JaxmemError(f"--data {part}: no such file or directory")
        files.extend(found)
    if not files:
        raise JaxmemError("--data names no files")
    return sorted(set(files))


def read_documents(path: str, field: str = "text") -> Iterator[str]:
    """The documents of one file: a text file is one; a JSONL line or a Parquet row is one (its
    ``field``)."""
    lower = path.lower()
    if lower.endswith(_JSON_SUFFIXES):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise JaxmemError(f"{path}:{number}: not a JSON line ({e.msg})") from None
                if not isinstance(record, dict) or field not in record:
                    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise JaxmemError(f"{path}:{number}: no field {field!r} (has: {keys}); pass --data-field NAME")
                yield str(record[field])
    elif lower.endswith(_PARQUET_SUFFIXES):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise JaxmemError(f"{path}: reading Parquet needs pyarrow: pip install 'jaxmem[data]'") from None
        table = pq.read_table(path)
        if field not in table.column_names:
            raise JaxmemError(
                f"{path}: no column {field!r} (has: {', '.join(table.column_names)}); pass --data-field NAME"
            )
        for value in table.column(field).to_pylist():
            if value is not None:
                yield str(value)
    else:
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()
        except UnicodeDecodeError as e:
            raise JaxmemError(
                f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it or leave it out"
            ) from None


def load_corpus(spec: str, *, tokenizer: str | Tokenizer | None = "byte", field: str = "text", saved=None) -> Corpus:
    """Read, tokenize and pack the documents a ``--data`` spec names.

    Args:
        spec: files, globs or directories (see :func:`list_files`); ``text`` is the embedded corpus.
        tokenizer: ``byte``, ``bpe:N`` (trained on these documents), a ``tokenizer.json``, or a
            :class:`Tokenizer`.
        field: the JSONL field / Parquet column holding the text.
        saved: a directory where a tokenizer trained for this run may already be (see
            :func:`get_tokenizer`).
    """
    if spec == "text":
        if tokenizer in (None, "byte") or isinstance(tokenizer, ByteTokenizer):
            return default_corpus()
        texts = [_pydoc_text()]
        return _pack(texts, get_tokenizer(tokenizer, texts, saved=saved), "pydoc topics")
    files = list_files(spec)
    texts = [doc for path in files for doc in read_documents(path, field)]
    texts = [t for t in texts if t]
    if not texts:
        raise JaxmemError(f"--data {spec}: the files hold no text")
    name = files[0] if len(files) == 1 else f"{len(files)} files under {os.path.commonpath(files) or '.'}"
    return _pack(texts, get_tokenizer(tokenizer, texts, saved=saved), name)


def _pydoc_text() -> str:
    return corpus_bytes().tobytes().decode("utf-8")


def _pack(texts: list[str], tok: Tokenizer, name: str) -> Corpus:
    pieces = []
    separator = np.asarray([tok.eos_id], np.int32) if tok.eos_id is not None else tok.encode("\n\n")
    for i, ids in enumerate(tok.encode_batch(texts)):
        if i:
            pieces.append(separator)
        pieces.append(ids)
    tokens = np.concatenate(pieces).astype(np.int32)
    return Corpus(tokens, tok, name, len(texts))
