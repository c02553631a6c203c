"""Share of a GEMM's tensor-core work that is useful after tile and wave quantization.

cuBLAS on Ampere computes the output in tiles of 256x128 (or 128x256) elements, one thread
block per tile, and runs the tiles in waves of one per SM: a partial tile still costs a whole
one, and a last wave that fills a few SMs costs as long as a full one (NVIDIA, "Matrix
Multiplication Background User's Guide", sections "Tile quantization" and "Wave
quantization"). At the shapes of a micro-batch of one 2k-token sequence under tensor parallelism
(2,048 rows, 1-2k columns per rank) this loses 10-45% of an A100, and it moves with the
micro-batch size and the TP degree, which a smooth efficiency curve does not capture.
"""

from __future__ import annotations

import numpy as np

# Output tile shapes (rows, columns) the library chooses between; its heuristic picks the
# orientation that wastes less.
TILES = ((256.0, 128.0), (128.0, 256.0))


def tile_fill(rows: np.ndarray, cols: np.ndarray | float, sms: float) -> np.ndarray:
    """Useful over executed tile work of a rows x cols output on `sms` streaming
    multiprocessors, for the better of the two tile orientations (1.0 at best)."""
    best = np.zeros_like(np.asarray(rows, dtype=np.float64) * cols)
    for tm, tn in TILES:
        tiles = np.ceil(rows / tm) * np.ceil(cols / tn)
        best = np.maximum(best, rows * cols / (np.ceil(tiles / sms) * sms * tm * tn))
    return best
