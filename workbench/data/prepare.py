"""`python -m workbench.data.prepare SRC OUT`: byte-tokenize a folder of text files into
memmapped shards (train.bin, val.bin, meta.json) for `data=tokens data.path=OUT`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

from workbench.cli import InputError, guarded
from workbench.data.corpus import write_shards

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".c", ".h")


@guarded
def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.data.prepare")
    ap.add_argument("src", type=Path, help="folder of text files (searched recursively)")
    ap.add_argument("out", type=Path, help="output folder")
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--max-bytes", type=int, default=1 << 40)
    ap.add_argument("--suffix", action="append", default=None,
                    help=f"file suffixes to read (default: {' '.join(TEXT_SUFFIXES)})")
    args = ap.parse_args(argv)
    if not args.src.is_dir():
        raise InputError(f"src={str(args.src)!r}: not a folder")
    if not 0 < args.val_frac < 0.5:
        raise InputError(f"--val-frac={args.val_frac}: must be in (0, 0.5)")
    suffixes = tuple(args.suffix or TEXT_SUFFIXES)
    files = sorted(p for p in args.src.rglob("*") if p.is_file() and p.suffix in suffixes)
    texts = ((str(p.relative_to(args.src)), p.read_bytes()) for p in files)
    data = write_shards(texts, args.out, args.val_frac, args.max_bytes, str(args.src))
    print(f"wrote {data.train.n_tokens} train + {data.val.n_tokens} val tokens to {args.out} "
          f"(sha256 {data.fingerprint[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
