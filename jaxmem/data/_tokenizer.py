"""Tokenizers: byte-level (the default, no files) and byte-level BPE from Hugging Face ``tokenizers``
(GPT-2's scheme), either trained on your data or loaded from a ``tokenizer.json``."""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

from jaxmem._errors import JaxmemError, setting

__all__ = ["BPETokenizer", "ByteTokenizer", "Tokenizer", "get_tokenizer"]

EOS = "<|endoftext|>"


class Tokenizer(abc.ABC):
    """Text <-> token ids (subclass it and define the abstract methods). ``eos_id`` separates
    documents in a packed stream (None: a blank line does).

    Attributes:
        name: what ``--tokenizer`` it came from (``byte``, ``bpe:4096``, a file).
        vocab_size: number of ids (the model's vocabulary must hold them all).
        eos_id: the end-of-document id, or None.
    """

    name: str
    vocab_size: int
    eos_id: int | None = None

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each text."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A short hash that changes whenever the id of any text would."""

    def save(self, directory: str) -> str | None:
        """Write what :func:`get_tokenizer` needs to load it again into ``directory``; the file, or None."""
        return None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; documents are joined by a blank line."""

    name = "byte"
    vocab_size = 256
    eos_id = None

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids):
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")

    def fingerprint(self):
        return "byte"

    def as_bpe(self) -> BPETokenizer:
        """The same ids as a Hugging Face ``tokenizers`` tokenizer (byte-level, no merges): what an
        exported byte-level model ships as its ``tokenizer.json``.

        >>> ByteTokenizer().as_bpe().encode("hé").tolist()
        [104, 195, 169]
        """
        tokenizers = _import_tokenizers()
        from tokenizers import decoders, models, pre_tokenizers

        # Byte-level pre-tokenization spells byte b as the character byte_char[b]; a BPE without merges
        # whose vocabulary gives that character id b keeps every byte its own id.
        vocab = {char: b for b, char in enumerate(_byte_chars())}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return BPETokenizer(tok, "byte")


def _byte_chars() -> list[str]:
    """The character byte-level BPE (GPT-2's scheme) writes for each byte 0..255: printable Latin-1
    bytes stand for themselves, the others take the code points from 256 upwards, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


MAX_BPE = 2**20  # the largest bpe:N trained (module functions below)


class BPETokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (byte-level BPE as GPT-2, or any ``tokenizer.json``)."""

    FILE = "tokenizer.json"

    def __init__(self, tokenizer, name: str):
        self._tok = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = tokenizer.token_to_id(EOS)

    @classmethod
    def load(cls, path: str, name: str | None = None) -> BPETokenizer:
        tokenizers = _import_tokenizers()
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises plain Exceptions for unreadable files
            raise JaxmemError(f"cannot load tokenizer {path!r}: {e}") from None
        return cls(tok, name or path)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """GPT-2's byte-level BPE with ``vocab_size`` ids (256 bytes + merges + ``<|endoftext|>``)."""
        tokenizers = _import_tokenizers()
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise JaxmemError(f"a BPE vocabulary needs more than the 256 bytes; got bpe:{vocab_size}")
        if vocab_size > MAX_BPE:
            raise JaxmemError(
                f"bpe:{vocab_size} is more ids than any model here would use (at most {MAX_BPE:,}; the largest "
                "open models use about 256k); pick e.g. bpe:32000"
            )
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        learned = tok.get_vocab_size()
        if learned < vocab_size:
            # The corpus ran out of pairs to merge: a run named bpe:N could not be resumed or shared
            # under that name, and its model would be sized for ids that never occur.
            raise JaxmemError(
                f"the data has only enough text for {learned} BPE ids, not the {vocab_size} of bpe:{vocab_size}; "
                f"use {setting('tokenizer', f'bpe:{learned}')} (or fewer), or more {setting('data')}"
            )
        return cls(tok, f"bpe:{vocab_size}")

    def encode_batch(self, texts):
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._tok.to_str()

    def fingerprint(self):
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def save(self, directory):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self.FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise JaxmemError(
            "BPE tokenizers need Hugging Face `tokenizers`: pip install 'jaxmem[data]' (or pip install tokenizers)"
        ) from None
    return tokenizers


def get_tokenizer(spec: str | Tokenizer | None, texts: Iterable[str] | None = None, saved: str | None = None):
    """The tokenizer a ``--tokenizer`` spec names.

    Args:
        spec: ``byte`` (default), ``bpe:N`` (train a byte-level BPE of N ids on ``texts``), or the path
            of a ``tokenizer.json`` (e.g. GPT-2's, from the Hugging Face hub).
        texts: the training text, needed to train ``bpe:N``.
        saved: a directory that may hold a tokenizer trained earlier for this run (a checkpoint
            directory); when it does, ``bpe:N`` loads it instead of training again.

    >>> get_tokenizer("byte").vocab_size
    256
    """
    if isinstance(spec, Tokenizer):
        return spec
    spec = (spec or "byte").strip()
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        try:
            size = int(spec[4:])
        except ValueError:
            raise JaxmemError(
                f"{setting('tokenizer')} bpe:N takes a vocabulary size, e.g. bpe:4096; got {spec!r}"
            ) from None
        if saved and os.path.exists(os.path.join(saved, BPETokenizer.FILE)):
            tok = BPETokenizer.load(os.path.join(saved, BPETokenizer.FILE), name=spec)
            if tok.vocab_size != size:
                raise JaxmemError(
                    f"{saved} holds a tokenizer of {tok.vocab_size} ids, not {size}; use "
                    f"{setting('tokenizer', f'bpe:{tok.vocab_size}')} to resume, or a new {setting('checkpoint_dir')}"
                )
            return tok
        if texts is None:
            raise JaxmemError(
                f"{setting('tokenizer', spec)} is trained on the data; give {setting('data')} (text files, "
                "JSONL, Parquet)"
            )
        return BPETokenizer.train(texts, size)
    if os.path.isfile(spec):
        return BPETokenizer.load(spec)
    raise JaxmemError(f"unknown tokenizer {spec!r}: use byte, bpe:N (e.g. bpe:4096) or the path of a tokenizer.json")
