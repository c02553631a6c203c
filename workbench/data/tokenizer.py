"""Tokenizers for shards: byte level (vocab 256, the embedded default) or any `tokenizers` BPE
(a local tokenizer.json, a hub name, or one trained here on the corpus itself).

Shards record the tokenizer's hash so that a run, its manifest and a mixture of sources can tell
whether token ids mean the same thing; ids from two tokenizers must never be mixed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np

from workbench.errors import InputError

BYTES = "bytes"
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BPE_EOT = "<|endoftext|>"


@dataclass(frozen=True)
class Tok:
    """A tokenizer as shards need it: plain data (a JSON string), so it crosses to workers."""

    name: str  # where it came from: bytes, a path, a hub name, trained-bpe-N
    vocab: int
    eot_id: int  # separates documents in a shard
    sha256: str  # of the canonical serialization (bytes: of the scheme name)
    json: Optional[str] = None  # tokenizers' serialization; None for bytes

    @property
    def dtype(self) -> str:
        """uint16 when every id fits, else uint32: half the disk and page cache for most
        vocabularies (GPT-2's 50257 fits; Llama 3's 128256 does not)."""
        return "uint16" if self.vocab <= 1 << 16 else "uint32"


def bytes_tokenizer() -> Tok:
    """Byte-level ids; documents end with a newline (id 10), as the shards always did."""
    return Tok(BYTES, 256, 10, hashlib.sha256(b"bytes-v1").hexdigest())


def from_json(text: str, name: str) -> Tok:
    """A `tokenizers` serialization; it must parse and name an end-of-text token."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise InputError(f"tokenizer={name!r}: does not parse as a tokenizers JSON file "
                         f"({str(e).splitlines()[0][:120]})") from None
    canon = tok.to_str()
    eot = next((tok.token_to_id(t) for t in EOT_CANDIDATES
                if tok.token_to_id(t) is not None), None)
    if eot is None:
        raise InputError(f"tokenizer={name!r}: has none of the end-of-text tokens "
                         f"{', '.join(EOT_CANDIDATES)}")
    return Tok(name, tok.get_vocab_size(with_added_tokens=True), int(eot),
               hashlib.sha256(canon.encode()).hexdigest(), canon)


def load(spec: str) -> Tok:
    """`bytes`, a tokenizer.json (or a folder holding one), or a hub name (needs the network)."""
    if spec == BYTES:
        return bytes_tokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return from_json(path.read_text(), spec)
        except UnicodeDecodeError:
            raise InputError(f"tokenizer={spec!r}: not a text file") from None
    if path.suffix == ".json" or spec.startswith((".", "/")):
        raise InputError(f"tokenizer={spec!r}: no such file")
    from workbench.data.hub import cached_or_downloaded

    return from_json(Path(cached_or_downloaded(spec, "tokenizer.json", "tokenizer")).read_text(),
                     spec)


def train_bpe(texts: Iterable[str], vocab_size: int, name: str = "") -> Tok:
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on `texts`, with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 257 < vocab_size <= 1 << 20:
        raise InputError(f"--train-tokenizer={vocab_size}: must be in (257, 1048576]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return from_json(tok.to_str(), name or f"trained-bpe-{vocab_size}")


class Encoder:
    """Encodes batches of documents into one flat id array, each document followed by EOT."""

    def __init__(self, tok: Tok):
        self.tok = tok
        self._hf = None
        if tok.json is not None:
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_str(tok.json)

    def encode(self, docs: List[str]) -> np.ndarray:
        dtype = np.dtype(self.tok.dtype)
        if self._hf is None:
            parts = [np.frombuffer(d.encode("utf-8", "surrogatepass") + b"\n", np.uint8)
                     for d in docs]
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
        encs = self._hf.encode_batch_fast(docs, add_special_tokens=False)
        eot = [self.tok.eot_id]
        flat: List[int] = []
        for e in encs:
            flat += e.ids
            flat += eot
        return np.asarray(flat, dtype=dtype)
