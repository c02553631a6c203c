"""The embedded corpus: the Python standard library's own source, real text on every machine
with Python, so a dry run needs no download. Built on first use and cached by everything that
shapes it (Python version, size, split, tokenizer); its fingerprint goes into every run's
manifest, because another Python version gives other text.

Besides the whole library, three parts of it serve as distinct sources for mixture studies:
`stdlib:tests` (the test suite), `stdlib:modules` (the other modules) and `stdlib:docs` (the
prose of their docstrings): code, code about code, and English.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import Iterator, List, Tuple

from workbench.config import DataConfig
from workbench.data import shards
from workbench.data import tokenizer as toks
from workbench.data.tokens import TokenData, cache_root, open_corpus, write_shards
from workbench.errors import ConfigError

PARTS = ("all", "tests", "modules", "docs")
SKIP = {"site-packages", "dist-packages", "__pycache__", "idlelib"}


def _root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(part: str) -> List[Path]:
    root = _root()
    files = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if SKIP.intersection(parts):
            continue
        is_test = bool({"test", "tests"}.intersection(parts))
        if (part == "tests") == is_test:
            files.append(p)
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n\n".join(d for d in (ast.get_docstring(n) for n in nodes) if d)


def documents(part: str, max_bytes: int) -> Iterator[Tuple[str, str]]:
    """(relative name, text) of one part, up to max_bytes of text in all."""
    root, total = _root(), 0
    for p in _files("modules" if part == "docs" else part):
        if total >= max_bytes:
            return
        text = _docstrings(p) if part == "docs" else p.read_bytes().decode("utf-8", "replace")
        text = text[: max_bytes - total]
        total += len(text)
        if text:
            yield str(p.relative_to(root)), text


def _tokenizer(cfg: DataConfig, folder: Path) -> toks.Tok:
    """bytes, bpe:N (trained on the whole embedded corpus, cached) or a tokenizer.json."""
    spec = cfg.tokenizer
    if spec == "bytes":
        return toks.bytes_tokenizer()
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise ConfigError("data.tokenizer", spec, "bpe:N needs an integer N") from None
        path = folder / f"bpe-{vocab}.json"
        if path.exists():
            return toks.from_json(path.read_text(), f"stdlib-bpe-{vocab}")
        tok = toks.train_bpe((t for _, t in documents("all", cfg.max_bytes)), vocab,
                             f"stdlib-bpe-{vocab}")
        shards.atomic_write(path, (tok.json or "").encode())
        return tok
    return toks.load(spec)


def part_tokens(cfg: DataConfig, part: str) -> TokenData:
    """One part of the embedded corpus as shards, built on first use and cached."""
    if part not in PARTS:
        raise ConfigError("data.sources", f"stdlib:{part}",
                          f"the embedded parts are {', '.join('stdlib:' + p for p in PARTS)}")
    base = cache_root(cfg)
    tok = _tokenizer(cfg, base / "tokenizers")
    tag = hashlib.sha256(f"{part}|{tok.sha256}|{sys.version}|{_root()}|{cfg.max_bytes}|"
                         f"{cfg.val_frac}".encode()).hexdigest()[:16]
    out = base / f"stdlib-{part}-{tag}"
    if not (out / "meta.json").exists():
        source = {"kind": "stdlib", "name": f"python-stdlib:{part} {_root()}",
                  "fingerprint": tag}
        shards.write(documents(part, cfg.max_bytes), out, tok, source, cfg.val_frac,
                     progress=False)
    return open_corpus(out)


def stdlib_tokens(cfg: DataConfig) -> TokenData:
    """The default corpus. Byte level keeps its original single-file layout (its runs stay
    bitwise what they were); any other tokenizer goes through the sharded writer."""
    if cfg.tokenizer != "bytes":
        return part_tokens(cfg, "all")
    root = _root()
    tag = hashlib.sha256(f"bytes-v1|{sys.version}|{root}|{cfg.max_bytes}|{cfg.val_frac}".encode())
    out = cache_root(cfg) / f"stdlib-{tag.hexdigest()[:16]}"
    if (out / "meta.json").exists():
        return open_corpus(out)
    files = [p for p in root.rglob("*.py")
             if not (SKIP | {"test", "tests"}).intersection(p.relative_to(root).parts)]
    files.sort(key=lambda p: str(p.relative_to(root)))
    texts = ((str(p.relative_to(root)), p.read_bytes()) for p in files)
    return write_shards(texts, out, cfg.val_frac, cfg.max_bytes, f"python-stdlib {root}")
