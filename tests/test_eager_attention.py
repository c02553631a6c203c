"""The bytes per attention score the cost model charges an eager (`kernel: torch`) attention
core, against the aten ops PyTorch's autograd runs for it, counted on CPU.

The core is the Aleph Alpha scaling stack's non-flash path, written here from its op list
(`baddbmm` into a 16-bit buffer, a view to (batch, heads, query, key), `masked_fill_` in place,
softmax, optionally with a cast to fp32 before and back after it, then `bmm` with V). A
dispatch mode sees every aten op of the forward and the backward. The count is the bytes each
non-GEMM op reads and writes once (a copy reads only its source, an allocation writes only what
it fills). Saved-tensor hooks see what autograd keeps. The ops are the same on CPU and CUDA;
the count is the HBM traffic only under the model's rule that a kernel streams its operands
once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from workbench.config import ModelConfig
from workbench.plan.accuracy.published import row_software
from workbench.plan.cost.activations import EAGER_SOFTMAX_SCORE_BYTES, activation_bytes_per_token
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software

GEMMS = {"bmm", "baddbmm", "mm", "addmm"}


class _OpBytes(TorchDispatchMode):
    """Bytes read + written by every non-GEMM, non-view aten op dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in GEMMS or name in ("detach", "empty", "empty_like"):
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name.startswith("new_empty"):
            ins, outs = [], []  # an allocation moves nothing
        elif name.startswith(("new_zeros", "zeros")):
            ins = []  # metadata only; the fill writes
        elif name == "copy_":
            ins = ins[1:]  # reads the source, writes the destination
        self.ops.append((name, sum(t.numel() * t.element_size() for t in ins + outs)))
        return out


def _core(b: int, n: int, s: int, d: int, fp32: bool):
    """(forward op bytes, backward op bytes, bytes autograd keeps) of one eager core."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b * n, s, d, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mask = ~torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).contiguous()
    grad = torch.randn(b * n, s, d, dtype=torch.bfloat16)
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 or (t.dim() == 3 and t.shape[-1] == s):  # the s*s tensors only
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with _OpBytes() as count, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        scores = torch.baddbmm(torch.empty(b * n, s, s, dtype=torch.bfloat16), q,
                               k.transpose(1, 2), beta=0.0, alpha=d ** -0.5)
        x = scores.view(b, n, s, s)
        if fp32:
            x = x.float()
        x.masked_fill_(mask, -10000.0)
        probs = torch.softmax(x, dim=-1)
        if fp32:
            probs = probs.to(torch.bfloat16)
        out = torch.bmm(probs.view(b * n, s, s), v)
        n_fwd = len(count.ops)
        out.backward(grad)
    per_query = {"mul", "copy_"}  # the alpha on dQ/dK and its copy: d/s of a score, not s*s
    fwd = sum(m for _, m in count.ops[:n_fwd])
    bwd = sum(m for name, m in count.ops[n_fwd:] if not (name in per_query and m < b * n * s * s))
    kept_bytes = sum(v for p, v in kept.items() if v >= b * n * s * s)  # not the [b,1,s,s] mask
    return fwd, bwd, kept_bytes


@pytest.mark.parametrize("softmax_bytes", [2.0, 4.0])
def test_eager_core_moves_and_keeps_what_the_model_charges(softmax_bytes: float) -> None:
    """Per score: the op-by-op total the cost model charges (EAGER_SOFTMAX_SCORE_BYTES) is the
    ops' forward + backward bytes less the mask's (1 byte per (sequence, query, key), read by
    masked_fill forward and backward: 2 / heads of a score), and what it keeps for the backward
    is the s*s tensors autograd saves."""
    b, n, s, d = 2, 4, 128, 16
    fwd, bwd, kept = _core(b, n, s, d, fp32=softmax_bytes == 4.0)
    scores = b * n * s * s
    moved, keeps = EAGER_SOFTMAX_SCORE_BYTES[softmax_bytes]
    assert (fwd + bwd) / scores - 2.0 / n == pytest.approx(moved)
    assert kept / scores == pytest.approx(keeps)


def test_16_bit_core_pays_autograds_copies_around_an_in_place_fill_of_a_view() -> None:
    """Why the 16-bit path is not 20 bytes: masked_fill_ on a view of the GEMM output makes
    autograd rebase the view (CopySlices), whose backward copies the gradient three times."""
    b, n, s, d = 1, 2, 64, 8
    fwd, bwd, _ = _core(b, n, s, d, fp32=False)
    assert fwd / (b * n * s * s) == pytest.approx(8.0 + 1.0 / n)
    assert bwd / (b * n * s * s) == pytest.approx(28.0 + 1.0 / n)


def test_a_rows_attention_kernel_selects_the_eager_core_and_it_costs_by_softmax_dtype() -> None:
    """A row's `attention_kernel` torch_softmax16 selects the eager core, torch_softmax32 its
    fp32 variant; a fused softmax or flash attention keeps the generic count. The fp32 core
    keeps three times the 16-bit one's score bytes."""
    def softmax_bytes(kernel: str) -> float:
        return row_software({"stack": "aleph_alpha_scaling", "precision": "BF16",
                             "attention_kernel": kernel}).eager_softmax_bytes

    assert softmax_bytes("torch_softmax16") == 2.0
    assert softmax_bytes("torch_softmax32") == 4.0
    assert softmax_bytes("fused_softmax") == softmax_bytes("flash2") == 0.0
    ms = model_shape(ModelConfig(name="13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40,
                                 ffn_hidden=13824, vocab=128000, seq_len=2048))
    tp, sp = np.array([1.0]), np.array([0.0])
    quad = {b: float(activation_bytes_per_token(
        ms, Software(flash_attention=False, eager_softmax_bytes=b), tp, sp)["quad"][0])
        for b in (0.0, 2.0, 4.0)}
    assert quad[0.0] == quad[2.0] == 2.0 * ms.n_heads * ms.seq_len
    assert quad[4.0] == 3 * quad[2.0]
