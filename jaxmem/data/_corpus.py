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

from jaxmem._errors import JaxmemError, setting
from jaxmem.data._tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = [
    "Corpus",
    "corpus_bytes",
    "default_corpus",
    "hf_documents",
    "list_files",
    "load_corpus",
    "parse_hf_spec",
    "read_documents",
]

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
            raise JaxmemError(f"{setting('eval_fraction')} is in [0, 1), got {eval_fraction}")
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
                    f"{setting('data', part)}: the directory holds no .txt, .md, .jsonl or .parquet files; name "
                    "the files "
                    "(a glob such as 'data/*.log' reads any file as text)"
                )
        elif any(c in part for c in "*?["):
            found = [p for p in glob.glob(part, recursive=True) if os.path.isfile(p)]
            if not found:
                raise JaxmemError(f"{setting('data', part)}: no file matches")
        elif os.path.isfile(part):
            found = [part]
        else:
            raise JaxmemError(f"{setting('data', part)}: no such file or directory")
        files.extend(found)
    if not files:
        raise JaxmemError(f"{setting('data', spec)} names no files")
    return sorted(set(files))


def read_documents(path: str, field: str = "text") -> Iterator[str]:
    """The documents of one file: a text file is one; a JSON-lines line (``.jsonl`` and ``.json`` files
    are both read as JSON lines) or a Parquet row is one (its ``field``)."""
    lower = path.lower()
    if lower.endswith(_JSON_SUFFIXES):
        with open(path, "rb") as f:
            for number, line in _utf8_lines(f, path):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise JaxmemError(f"{path}:{number}: not a JSON line ({e.msg})") from None
                if not isinstance(record, dict) or field not in record:
                    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise JaxmemError(
                        f"{path}:{number}: no field {field!r} (has: {keys}); name it with {setting('data_field')}"
                    )
                yield str(record[field])
    elif lower.endswith(_PARQUET_SUFFIXES):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise JaxmemError(f"{path}: reading Parquet needs pyarrow: pip install 'jaxmem[data]'") from None
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise JaxmemError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
        if field not in table.column_names:
            raise JaxmemError(
                f"{path}: no column {field!r} (has: {', '.join(table.column_names)}); name it with "
                f"{setting('data_field')}"
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


def _utf8_lines(f, path: str):
    """``(number, line)`` of a file opened in binary, each line decoded as UTF-8 (universal newlines
    as text mode reads them); a clear error naming the first line that is not UTF-8."""
    for number, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JaxmemError(
                f"{path}:{number}: not UTF-8 text ({e.reason}); a JSON-lines file holds one JSON object per line "
                "of UTF-8 text. Convert it or leave it out"
            ) from None
        yield number, line.replace("\r\n", "\n").replace("\r", "\n")


HF_PREFIX = "hf:"


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:NAME``, ``hf:NAME:SPLIT`` or ``hf:NAME:CONFIG:SPLIT`` -> (name, config, split); the
    split defaults to ``train``."""
    parts = spec[len(HF_PREFIX) :].split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise JaxmemError(
            f"{setting('data', spec)}: write hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT (e.g. "
            "hf:wikitext:wikitext-2-raw-v1:train)"
        )
    if len(parts) == 1:
        return parts[0], None, "train"
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def hf_documents(spec: str, field: str = "text") -> tuple[list[str], str]:
    """The documents of a Hugging Face dataset (``hf:NAME[:CONFIG]:SPLIT``, see :func:`parse_hf_spec`)
    and a name for them. NAME is a hub dataset already in the local cache (nothing is downloaded:
    the hub is read offline), a directory written by ``Dataset.save_to_disk``, or a local directory
    of data files laid out like a hub dataset. Needs ``pip install 'jaxmem[hf]'``."""
    name, config, split = parse_hf_spec(spec)
    try:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import datasets
    except ImportError:
        raise JaxmemError(
            f"{setting('data', spec)}: Hugging Face datasets need the datasets package: pip install 'jaxmem[hf]'"
        ) from None
    datasets.disable_progress_bars()
    path = os.path.expanduser(name)
    try:
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "state.json")):
            data = datasets.load_from_disk(path)  # one saved split
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            saved = datasets.load_from_disk(path)
            if split not in saved:
                raise JaxmemError(f"{setting('data', spec)}: no split {split!r} (has: {', '.join(saved)})")
            data = saved[split]
        else:
            data = datasets.load_dataset(_hub_snapshot(name) or path, config, split=split)
    except JaxmemError:
        raise
    except (FileNotFoundError, ConnectionError, ValueError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if "split" in first.lower():
            raise JaxmemError(f"{setting('data', spec)}: {first}") from None
        where = os.environ.get("HF_HOME", os.path.join("~", ".cache", "huggingface"))
        args = ", ".join([repr(name)] + ([repr(config)] if config else []) + [f"split={split!r}"])
        raise JaxmemError(
            f"{setting('data', spec)}: cannot load it offline ({type(e).__name__}: {first}). A hub dataset must "
            "already be "
            f"in the local cache ({where}): fetch it once where there is network, e.g. "
            f'python -c "import datasets; datasets.load_dataset({args})"'
        ) from None
    if field not in data.column_names:
        raise JaxmemError(
            f"{setting('data', spec)}: no column {field!r} (has: {', '.join(data.column_names)}); name it with "
            f"{setting('data_field')}"
        )
    texts = [str(v) for v in data[field] if v]
    return texts, f"{name} ({config + ', ' if config else ''}{split})"


def _hub_snapshot(name: str) -> str | None:
    """The local snapshot directory of hub dataset ``name`` in the Hugging Face hub cache, if there."""
    if os.path.isdir(os.path.expanduser(name)):
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:  # not cached, or not a hub name: datasets' own cache may still have it
        return None


def load_corpus(spec: str, *, tokenizer: str | Tokenizer | None = "byte", field: str = "text", saved=None) -> Corpus:
    """Read, tokenize and pack the documents a ``--data`` spec names.

    Args:
        spec: files, globs or directories (see :func:`list_files`); ``text`` is the embedded corpus;
            ``hf:NAME[:CONFIG]:SPLIT`` a Hugging Face dataset (see :func:`hf_documents`).
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
    if spec.startswith(HF_PREFIX):
        texts, name = hf_documents(spec, field)
        if not texts:
            raise JaxmemError(f"{setting('data', spec)}: column {field!r} holds no text")
        return _pack(texts, get_tokenizer(tokenizer, texts, saved=saved), name)
    files = list_files(spec)
    if field != "text" and not any(f.lower().endswith(_JSON_SUFFIXES + _PARQUET_SUFFIXES) for f in files):
        raise JaxmemError(
            f"{setting('data_field', field)} names a JSONL field or Parquet column, but {setting('data', spec)} is "
            f"plain text files (each file is one document). Drop {setting('data_field')}"
        )
    texts = [doc for path in files for doc in read_documents(path, field)]
    texts = [t for t in texts if t]
    if not texts:
        raise JaxmemError(f"{setting('data', spec)}: the files hold no text")
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
