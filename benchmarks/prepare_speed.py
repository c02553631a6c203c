"""prepare's tokens/s on every core against a plain single-process `tokenizers` loop.

`python benchmarks/prepare_speed.py [--mb 16] [--vocab 4096]`: writes a JSONL corpus of the
standard library's source (about MB megabytes), trains one BPE on it, then measures in the same
run, each in its own process:

(a) the baseline the issue names, a plain single-process loop: the documents already in memory
    (empty ones skipped, as prepare does, so both count the same tokens),
    `Tokenizer.encode_batch` in batches of 256 with `TOKENIZERS_PARALLELISM=false` (one core),
    ids collected into numpy arrays; only the encoding is timed;
(b) the same loop with tokenizers' own threads on (every core), printed for reference: the
    most a single process can get out of the library;
(c) `python -m workbench.data.prepare` with that tokenizer.json on all cores, timed as a whole
    command (interpreter start, imports, reading the JSONL and writing shards included).

Prints the three rates and the ratios of (c) to (a) (target: >= 1.5x on 2 cores) and to (b).
At the default 16 MB the start-up (about 1.3 s: imports, `datasets` opening the JSONL) is a
quarter of prepare's time; at 1 MB (the README test's size) it is most of it.
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


LOOP = """
import json, sys, time
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
docs = [d for d in (json.loads(line)["text"] for line in open(sys.argv[2])) if d]
t0 = time.perf_counter()
n = 0
for i in range(0, len(docs), 256):
    for enc in tok.encode_batch(docs[i:i + 256], add_special_tokens=False):
        n += len(np.asarray(enc.ids, dtype=np.uint16)) + 1
print(n, time.perf_counter() - t0)
"""


def encode_loop(tok_file: Path, jsonl: Path, threads: bool) -> tuple:
    """(tokens, seconds) of the plain encode_batch loop, in a fresh process so that the
    tokenizers thread setting takes effect before the library starts its pool."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true" if threads else "false")
    out = subprocess.run([sys.executable, "-c", LOOP, str(tok_file), str(jsonl)], env=env,
                         check=True, capture_output=True, text=True).stdout.split()
    return int(out[0]), float(out[1])


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
        n_one, t_one = encode_loop(d / "tokenizer.json", d / "c.jsonl", threads=False)
        n_thr, t_thr = encode_loop(d / "tokenizer.json", d / "c.jsonl", threads=True)
        cmd = [sys.executable, "-m", "workbench.data.prepare", str(d / "c.jsonl"),
               str(d / "out"), "--tokenizer", str(d / "tokenizer.json"), "--shard-mb", "2"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        t_prep = time.perf_counter() - t0  # whole command: imports and reading included
        meta = json.loads((d / "out" / "meta.json").read_text())
        n_prep = meta["train_tokens"] + meta["val_tokens"]
    one, thr, prep = n_one / t_one, n_thr / t_thr, n_prep / t_prep
    print(f"corpus {args.mb:.0f} MB, vocab {args.vocab}, {os.cpu_count()} cores")
    print(f"baseline encode_batch loop, one process, one core: {n_one:,} tokens in "
          f"{t_one:.1f} s = {one:,.0f} tok/s")
    print(f"reference encode_batch loop, tokenizers' threads on: {n_thr:,} tokens in "
          f"{t_thr:.1f} s = {thr:,.0f} tok/s")
    print(f"prepare (all cores, whole command): {n_prep:,} tokens in {t_prep:.1f} s = "
          f"{prep:,.0f} tok/s")
    print(f"ratio prepare / baseline: {prep / one:.2f}x (target >= 1.5x); "
          f"prepare / threaded loop: {prep / thr:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
