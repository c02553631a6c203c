"""Where documents come from: local JSONL / Parquet / CSV / text files and Hugging Face datasets
through the `datasets` library (streamed, so a corpus never has to fit in memory), or a folder
of text files (one file, one document).

Every source yields (key, text) pairs; the key decides the train/validation split by hash, so
validation holds whole documents. Its fingerprint goes into the shards' meta and the run's
manifest: file contents for local files, name/config/split/revision for a hub dataset.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from workbench.errors import InputError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".c", ".h")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
            ".txt": "text", ".text": "text"}
Docs = Iterator[Tuple[str, str]]


def _datasets() -> Any:
    """`datasets`, without its torch integration when torch is not loaded yet: prepare has no
    use for it and importing torch costs seconds."""
    if "datasets" not in sys.modules and "torch" not in sys.modules:
        os.environ.setdefault("USE_TORCH", "0")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # errors end as one line of ours
    return datasets


def _file_fingerprint(files: List[Path], root: Path) -> str:
    sha = hashlib.sha256()
    for p in files:
        sha.update(str(p.relative_to(root) if p != root else p.name).encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
    return sha.hexdigest()


def folder_docs(src: Path, suffixes: Tuple[str, ...]) -> Tuple[Dict[str, Any], Docs]:
    """A folder of text files, searched recursively; one file is one document."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise InputError(f"src={str(src)!r}: no files ending in {' '.join(suffixes)}")

    def docs() -> Docs:
        for p in files:
            try:
                text = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"src file {str(p)!r}: not UTF-8 text ({e.reason} at byte "
                                 f"{e.start})") from None
            if text:
                yield str(p.relative_to(src)), text

    return {"kind": "folder", "name": str(src),
            "fingerprint": _file_fingerprint(files, src), "files": len(files)}, docs()


def _rows(ds: Any, text_field: str, name: str, batch_rows: int = 1024) -> Docs:
    """(key, text) from dataset rows, read in columnar batches (Arrow to Python once per
    batch, not per row: the reader stays ahead of the encoding workers); bad rows or
    unreadable files end as one-line errors."""
    it = iter(ds.iter(batch_size=batch_rows))
    i = 0
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except InputError:
            raise
        except Exception as e:  # pyarrow / datasets errors on malformed or undecodable files
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise InputError(f"src={name!r}: cannot read row {i} ({first[:160]})") from None
        if text_field not in batch:
            raise InputError(f"--text-field={text_field!r}: not a field of {name!r}; fields: "
                             f"{', '.join(map(str, batch))}")
        for text in batch[text_field]:
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise InputError(f"--text-field={text_field!r}: holds {type(text).__name__}, "
                                 f"not text, in {name!r}")
            if text:
                yield str(i), text
            i += 1


def file_docs(files: List[Path], text_field: str) -> Tuple[Dict[str, Any], Docs]:
    """JSONL, Parquet, CSV or plain text files (one builder for all: same suffix family). A
    plain text file yields one document per blank-line-separated paragraph."""
    datasets = _datasets()
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) != 1:
        raise InputError(f"src={', '.join(map(str, files))!r}: give files of one kind: "
                         f"{', '.join(sorted(BUILDERS))}")
    for p in files:
        if p.stat().st_size == 0:
            raise InputError(f"src file {str(p)!r}: is empty")
    builder = kinds.pop()
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train",
                                   streaming=True, **kwargs)
    except Exception as e:
        raise InputError(f"src={str(files[0])!r}: cannot open as {builder} "
                         f"({str(e).splitlines()[0][:160]})") from None
    field = "text" if builder == "text" else text_field
    root = files[0].parent
    return {"kind": builder, "name": ", ".join(map(str, files)),
            "fingerprint": _file_fingerprint(files, root), "files": len(files)}, \
        _rows(ds, field, str(files[0]))


def hub_docs(name: str, config: Optional[str], split: str,
             text_field: str) -> Tuple[Dict[str, Any], Docs]:
    """A Hugging Face dataset, streamed (needs the network); fingerprinted by its identity and
    the revision the hub resolved."""
    from workbench.data.hub import hub_offline_reason

    offline = hub_offline_reason()  # streaming reads the hub itself: no cache to fall back on
    if offline:
        raise InputError(f"src=hf:{name}: streaming needs the hub, which is unreachable: "
                         f"{offline}")
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        raise InputError(f"src=hf:{name}: cannot load ({str(e).splitlines()[0][:160]})") from None
    ident = f"hf:{name}:{config or ''}:{split}:{getattr(ds.info, 'version', '')}"
    return {"kind": "hub", "name": ident,
            "fingerprint": hashlib.sha256(ident.encode()).hexdigest()}, \
        _rows(ds, text_field, name)


def open_source(src: List[str], text_field: str = "text", hf_config: Optional[str] = None,
                hf_split: str = "train",
                suffixes: Tuple[str, ...] = TEXT_SUFFIXES) -> Tuple[Dict[str, Any], Docs]:
    """SRC as the user typed it: one folder, local files, or hf:NAME (a hub dataset)."""
    if len(src) == 1 and src[0].startswith("hf:"):
        return hub_docs(src[0][3:], hf_config, hf_split, text_field)
    paths = [Path(s) for s in src]
    for p in paths:
        if not p.exists():
            raise InputError(f"src={str(p)!r}: no such file or folder")
    if len(paths) == 1 and paths[0].is_dir():
        return folder_docs(paths[0], suffixes)
    if any(p.is_dir() for p in paths):
        raise InputError(f"src={src!r}: give one folder, or files")
    return file_docs(paths, text_field)
