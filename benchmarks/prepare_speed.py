"""prepare's tokens/s on every core against a plain single-process `tokenizers` loop.

`python benchmarks/prepare_speed.py [--mb 16] [--vocab 4096]`: writes a JSONL corpus of the
standard library's source (about MB megabytes), trains one BPE on it, then measures in the same
run (a) the baseline: one process reading the same documents and calling
`Tokenizer.encode_batch` in batches of 256 (tokenizers' own threads on, as a user would run it),
collecting ids into numpy arrays; (b) `python -m workbench.data.prepare` with that tokenizer.json
on all cores. Prints both rates and their ratio (target: >= 1.5x on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np


def corpus(path: Path, mb: float) -> list:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for p in sorted(root.rglob("*.py")):
        if size >= mb * 1e6:
            break
        text = p.read_bytes().decode("utf-8", "replace")
        docs.append(text)
        size += len(text)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def baseline(tok_file: Path, docs: list) -> tuple:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(docs), 256):
        for enc in tok.encode_batch(docs[i:i + 256], add_special_tokens=False):
            n += len(np.asarray(enc.ids, dtype=np.uint16)) + 1
    return n, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=16.0)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        docs = corpus(d / "c.jsonl", args.mb)
        from workbench.data.tokenizer import train_bpe

        tok = train_bpe(docs[: max(1, len(docs) // 8)], args.vocab)
        (d / "tokenizer.json").write_text(tok.json or "")
        n_base, t_base = baseline(d / "tokenizer.json", docs)
        cmd = [sys.executable, "-m", "workbench.data.prepare", str(d / "c.jsonl"),
               str(d / "out"), "--tokenizer", str(d / "tokenizer.json"), "--shard-mb", "2"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        t_prep = time.perf_counter() - t0  # whole command: imports and reading included
        meta = json.loads((d / "out" / "meta.json").read_text())
        n_prep = meta["train_tokens"] + meta["val_tokens"]
    base, prep = n_base / t_base, n_prep / t_prep
    print(f"corpus {args.mb:.0f} MB, vocab {args.vocab}, {os.cpu_count()} cores")
    print(f"baseline encode_batch loop: {n_base:,} tokens in {t_base:.1f} s = {base:,.0f} tok/s")
    print(f"prepare (all cores, whole command): {n_prep:,} tokens in {t_prep:.1f} s = "
          f"{prep:,.0f} tok/s")
    print(f"ratio prepare / baseline: {prep / base:.2f}x (target >= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
