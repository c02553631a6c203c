"""`python -m workbench.data.prepare SRC... OUT`: a corpus in, token shards out, for
`data=tokens data.path=OUT`.

SRC is a folder of text files, local JSONL / Parquet / CSV / text files, `hf:NAME` (a Hugging
Face dataset, streamed; `--hf-config`, `--hf-split`), or `megatron:PREFIX` (a Megatron-LM / NeMo
indexed dataset, PREFIX.bin + PREFIX.idx, already tokenized by `--tokenizer`:
workbench.data.megatron). The tokenizer is byte level unless `--tokenizer` names a
tokenizer.json or a hub tokenizer, or `--train-tokenizer N` trains an N-token byte-level BPE on
(the first `--train-sample-mb` of) the corpus, saved beside the shards.
Runs in parallel on every core (`--workers`), resumes after a kill, and leaves OUT without a
meta.json until every shard is whole.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from workbench.cli import ArgParser, guarded
from workbench.data import megatron, shards
from workbench.data import tokenizer as toks
from workbench.data.sources import TEXT_SUFFIXES, open_source
from workbench.errors import InputError


def _parser() -> ArgParser:
    ap = ArgParser(prog="python -m workbench.data.prepare")
    ap.add_argument("paths", nargs="+", help="SRC... OUT: sources, then the output folder")
    ap.add_argument("--text-field", default="text", help="JSONL/Parquet/CSV/hub column")
    ap.add_argument("--tokenizer", default="bytes",
                    help="bytes | a tokenizer.json (or its folder) | a hub name")
    ap.add_argument("--train-tokenizer", type=int, default=0, metavar="VOCAB_SIZE",
                    help="train a byte-level BPE of this size on the corpus")
    ap.add_argument("--train-sample-mb", type=float, default=64.0,
                    help="text used to train the tokenizer, MB (the corpus' first documents)")
    ap.add_argument("--hf-config", default=None)
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--max-bytes", type=int, default=1 << 50, help="stop after this much text")
    ap.add_argument("--shard-mb", type=float, default=32.0, help="text per shard, MB")
    ap.add_argument("--workers", type=int, default=0, help="processes (0: every core)")
    ap.add_argument("--suffix", action="append", default=None,
                    help=f"folder: file suffixes to read (default: {' '.join(TEXT_SUFFIXES)})")
    return ap


def _tokenizer(args: Any, src: List[str], out: Path) -> toks.Tok:
    """The tokenizer to use; a trained one is reused from OUT when a killed prepare resumes."""
    if not args.train_tokenizer:
        return toks.load(args.tokenizer)
    if args.tokenizer != "bytes":
        raise InputError("--tokenizer and --train-tokenizer: give one of them")
    saved = out / "tokenizer.json"
    trained = out / ".trained-tokenizer.json"
    for path in (trained, saved):
        if path.exists():
            tok = toks.from_json(path.read_text(), f"trained-bpe-{args.train_tokenizer}")
            if tok.vocab == args.train_tokenizer:
                return tok
    _, docs = _open(args, src)
    sample = (t for _, t in shards.capped(docs, int(args.train_sample_mb * 1e6)))
    tok = toks.train_bpe(sample, args.train_tokenizer)
    shards.atomic_write(trained, (tok.json or "").encode())
    return tok


def _open(args: Any, src: List[str]):
    suffixes = tuple(args.suffix or TEXT_SUFFIXES)
    source, docs = open_source(src, args.text_field, args.hf_config, args.hf_split, suffixes)
    return source, shards.capped(docs, args.max_bytes)


def prepare(argv: List[str]) -> Tuple[Dict[str, Any], Path]:
    """Parse, check, tokenize; returns the meta of the finished folder and the folder."""
    args = _parser().parse_args(argv)
    if len(args.paths) < 2:
        raise InputError("python -m workbench.data.prepare: give SRC... OUT")
    src, out = args.paths[:-1], Path(args.paths[-1])
    if not 0 < args.val_frac < 0.5:
        raise InputError(f"--val-frac={args.val_frac}: must be in (0, 0.5)")
    if args.shard_mb <= 0 or args.max_bytes <= 0 or args.workers < 0:
        raise InputError("--shard-mb and --max-bytes must be > 0, --workers >= 0")
    if out.exists() and not out.is_dir():
        raise InputError(f"out={str(out)!r}: exists and is not a folder")
    if src[0].startswith(megatron.PREFIX):
        return _imported(args, src, out), out
    source, docs = _open(args, src)  # checks SRC before anything is written
    first = list(itertools.islice(docs, 1))  # an unreadable first row fails before OUT exists
    tok = _tokenizer(args, src, out)
    meta = shards.write(itertools.chain(first, docs), out, tok, source, args.val_frac,
                        int(args.shard_mb * 1e6), args.workers)
    (out / ".trained-tokenizer.json").unlink(missing_ok=True)
    return meta, out


def _imported(args: Any, src: List[str], out: Path) -> Dict[str, Any]:
    """A Megatron indexed dataset: its ids as they are, under the tokenizer that made them."""
    if len(src) != 1 or args.train_tokenizer:
        raise InputError(f"src={' '.join(src)!r}: {megatron.PREFIX}PREFIX is one source, "
                         "already tokenized (name its tokenizer with --tokenizer)")
    tok = toks.load(args.tokenizer)
    return megatron.prepare(src[0][len(megatron.PREFIX):], out, tok, args.val_frac,
                            int(args.shard_mb * 1e6))


@guarded
def main(argv: List[str]) -> int:
    t0 = time.perf_counter()
    meta, out = prepare(argv)
    dt = time.perf_counter() - t0
    n = meta["train_tokens"] + meta["val_tokens"]
    print(f"wrote {meta['train_tokens']} train + {meta['val_tokens']} val tokens "
          f"({meta['train_docs']} + {meta['val_docs']} documents, vocab {meta['vocab']}, "
          f"{meta['dtype']}) to {out} in {dt:.1f} s ({n / dt:,.0f} tokens/s;"
          f" sha256 {meta['fingerprint'][:12]}, tokenizer {meta['tokenizer']['sha256'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
