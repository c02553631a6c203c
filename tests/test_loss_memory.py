"""The bytes per logit the cost model itemizes for a gathered-logits stack (the Aleph Alpha
scaling code's last pipeline stage) against the peak the same PyTorch ops allocate, measured.

Measured on CPU as the high-water mark of the resident size (Linux VmHWM, reset through
/proc/self/clear_refs; ru_maxrss would carry the forking parent's over exec) in a fresh
interpreter: tensors this large are mmap-backed by the C allocator and returned on free, so the
high-water mark is the sum of the tensors alive at once (no caching allocator in between; its
fragmentation is a separate allowance, Coefficients.mem_frag)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from workbench.plan.cost.activations import gathered_loss_bytes_per_logit
from workbench.plan.cost.software import Software

# The last stage's loss step of scaling's pipeline engine, op for op: the LM head's 16-bit
# logits are written to the stage-output buffer ring (the previous micro-batch's are still
# there), losses/cross_entropy.py takes `.float()`, a per-token cross-entropy weighted by the
# loss weights and an argmax accuracy, then optimizer.py `backward` on `loss.float()`.
LOSS_STEP = r"""
import sys, torch
tokens, hidden, vocab = int(sys.argv[1]), 64, 32000
torch.manual_seed(0)
x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
w = (0.02 * torch.randn(vocab, hidden, dtype=torch.bfloat16)).requires_grad_(True)
target, weights = torch.randint(0, vocab, (tokens,)), torch.ones(tokens)
ring = {0: (x @ w.t()).detach()}  # the previous micro-batch's output, never taken
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) * 1024
with open("/proc/self/clear_refs", "w") as f:  # restart the high-water mark from here
    f.write("5")
before = peak()
ring[1] = x @ w.t()
logits = ring[1].float().reshape(-1, vocab)
losses = torch.nn.functional.cross_entropy(logits, target=target, reduction="none")
loss = torch.sum(losses * weights) / weights.sum()
accuracy = (logits.argmax(-1) == target).float().mean()
del logits
loss.float().backward()
print((peak() - before) / (tokens * vocab))
"""


def _measured_bytes_per_logit(tokens: int) -> float:
    # A fixed mmap threshold (glibc) so every tensor of a logits' size is mapped and unmapped
    # on free whatever the allocator saw before; one thread, so no per-thread kernel buffers.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run([sys.executable, "-c", LOSS_STEP, str(tokens)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip())


def test_gathered_loss_itemization_matches_the_ops_peak() -> None:
    """The ops' peak above what was alive before (the stale buffer of the previous micro-batch:
    2 bytes) is this micro-batch's logits and the three fp32 tensors of the loss backward: 14;
    with the stale copy the 16 the cost model counts from the second micro-batch on. With the
    rows' 128k vocabulary, every full-recompute hagemann2023 layout that ran tolerates >= 16.1
    bytes per logit (README), so these ops account for its loss."""
    itemized = float(gathered_loss_bytes_per_logit(Software(gathered_logits=True),
                                                   np.array([4.0]))[0])
    measured = _measured_bytes_per_logit(1024) + 2.0
    assert itemized == 16.0
    assert measured == pytest.approx(itemized, abs=1.0), f"measured {measured:.2f} bytes/logit"
