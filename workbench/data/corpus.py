"""The run's data, whatever its kind: the embedded corpus, a prepared folder, or a mixture.

The single-corpus machinery lives in workbench.data.tokens, mixtures in workbench.data.mixture;
this module only dispatches (and re-exports what the loop and benchmarks import), so neither of
those needs the other's loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from workbench.config import DataConfig
from workbench.data.mixture import Mixture, build_mixture, open_mixture
from workbench.data.tokens import (  # noqa: F401
    TokenData,
    TokenSplit,
    batch_offsets,
    cache_root,
    gather,
    open_corpus,
    resolve_vocab,
    write_shards,
)

Data = Union[TokenData, Mixture]


def open_tokens(folder: Path) -> Data:
    """A data folder as a job file names it: one corpus, or a mixture.json."""
    if (Path(folder) / "mixture.json").exists():
        return open_mixture(Path(folder))
    return open_corpus(Path(folder))


def load(cfg: DataConfig) -> Data:
    """The run's data: the embedded corpus, a prepared folder, or a mixture of sources."""
    if cfg.sources:
        return build_mixture(cfg)
    if cfg.name == "stdlib":
        from workbench.data.stdlib import stdlib_tokens

        return stdlib_tokens(cfg)
    return open_corpus(Path(cfg.path))
