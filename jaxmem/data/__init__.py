"""Training data: corpora read from text files, JSONL or Parquet (or the embedded default, CPython's
``pydoc_data.topics``), tokenized byte-level or with a BPE tokenizer, packed into one token stream and
cut into windows; and a deterministic, resumable batch iterator over them (Grain's index shuffle), so
a resumed or re-meshed run consumes every sample exactly once. A model with a batch of its own (a
classifier's images and labels) trains on :class:`Samples`, batched and shuffled the same way."""

from jaxmem.data._corpus import Corpus as Corpus
from jaxmem.data._corpus import corpus_bytes as corpus_bytes
from jaxmem.data._corpus import default_corpus as default_corpus
from jaxmem.data._corpus import hf_documents as hf_documents
from jaxmem.data._corpus import list_files as list_files
from jaxmem.data._corpus import load_corpus as load_corpus
from jaxmem.data._corpus import parse_hf_spec as parse_hf_spec
from jaxmem.data._corpus import read_documents as read_documents
from jaxmem.data._iterator import ORDER as ORDER
from jaxmem.data._iterator import Batch as Batch
from jaxmem.data._iterator import DataIterator as DataIterator
from jaxmem.data._iterator import make_data as make_data
from jaxmem.data._samples import SampleBatch as SampleBatch
from jaxmem.data._samples import SampleIterator as SampleIterator
from jaxmem.data._samples import Samples as Samples
from jaxmem.data._samples import load_samples as load_samples
from jaxmem.data._tokenizer import EOS as EOS
from jaxmem.data._tokenizer import BPETokenizer as BPETokenizer
from jaxmem.data._tokenizer import ByteTokenizer as ByteTokenizer
from jaxmem.data._tokenizer import Tokenizer as Tokenizer
from jaxmem.data._tokenizer import get_tokenizer as get_tokenizer
