"""How much of the tensor-core peak a GEMM of a given shape keeps.

Two views of the same loss. The smooth one (`dim_fill`): a dimension of a few tens of rows or
columns wastes most of a 128-256 wide tile, so efficiency falls as d / (d + half). The exact one
(`tile_fill`): cuBLAS on Ampere computes the output in tiles of 256x128 (or 128x256) elements,
one thread block per tile, and runs the tiles in waves of one per SM: a partial tile still costs
a whole one, and a last wave that fills a few SMs costs as long as a full one (NVIDIA, "Matrix
Multiplication Background User's Guide", sections "Tile quantization" and "Wave quantization").
The loss moves with the micro-batch and the TP degree, which the smooth curve does not capture
(Coefficients.gemm_tile_waves chooses).
"""

from __future__ import annotations

import numpy as np

# Output tile shapes (rows, columns) the library chooses between; its heuristic picks the
# orientation that wastes less.
TILES = ((256.0, 128.0), (128.0, 256.0))


def dim_fill(dim: np.ndarray | float, half: float) -> np.ndarray:
    """Fraction of GEMM efficiency kept at dimension `dim` (tile/wave quantization, smoothed):
    half of it where dim == half."""
    return dim / (dim + half)


def tile_fill(rows: np.ndarray, cols: np.ndarray | float, sms: float) -> np.ndarray:
    """Useful over executed tile work of a rows x cols output on `sms` streaming
    multiprocessors, for the better of the two tile orientations (1.0 at best)."""
    best = np.zeros_like(np.asarray(rows, dtype=np.float64) * cols)
    for tile_rows, tile_cols in TILES:
        tiles = np.ceil(rows / tile_rows) * np.ceil(cols / tile_cols)
        best = np.maximum(best, rows * cols / (np.ceil(tiles / sms) * sms * tile_rows * tile_cols))
    return best
