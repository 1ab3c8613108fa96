"""fp16 matmuls on a CPU as fp16 tensor cores compute them: fp16 operands, fp32 products and sums, the result
rounded to fp16 once.

torch's CPU kernels for fp16 matrix products have no fp16 hardware to run on on most CPUs. Where one operand
is used transposed, as in every backward through a linear layer (the gradient times the weight), they fall to a
slow path (a [48 x 32,768] by [32,768 x 640] product: 2.0 s against 0.03 s here, on one AVX512-BF16 EPYC core;
benchmarks/cpu_fp16_matmul.py), so a real model's fp16 step spent 99 % of its time there (Gemma 3
270M, 48 tokens: 141 s; its first 6 layers and head: 130 s, and 3.9 s with these kernels). They accumulate in
fp32 too, so the arithmetic is the same: the product of two fp16 values is exact in fp32, the sum is fp32, and
the result is rounded to fp16 once, as a GPU's fp16 GEMM with fp32 accumulation rounds it. Only the order of
the fp32 sums differs; on that step the loss agreed to 3e-5 and the LoRA gradients were as close to an fp32
step's (0.51 % apart) as torch's own fp16 kernels' (0.53 %).

`install()` replaces the CPU kernels of aten's mm, addmm, bmm and baddbmm for this process (a worker trains
one cell). fp16 operands are multiplied in fp32 in blocks of at most BLOCK_ELEMENTS fp32 values per operand
block, each block's result rounded to fp16 where it lands, so the fp32 copies stay small beside the model (the
transposed head of Gemma 3 would otherwise be a 671 MB copy); every other dtype goes to torch's own kernel
through the operator's out= form, which the replacement leaves in place (replaced, it would leave them no kernel
of torch's to call). torch's CPU grouped matmul (the routed experts' in transformers) runs one mm.out per expert,
so those products are torch's fp16 kernels, oneDNN's on a CPU whose oneDNN runs fp16, where the plan turns
oneDNN off for cells with routed experts (tunegrid.prepare.cpu_kernels.cpu_onednn_off).
"""

from __future__ import annotations

import warnings
from typing import Any

BLOCK_ELEMENTS = 2**21  # fp32 values per operand block (8 MiB): bounded transient memory, GEMM-sized blocks
_LIBRARY: list[Any] = []  # the registration lives as long as this reference


def installed() -> bool:
    return bool(_LIBRARY)


def uninstall() -> None:
    """torch's own kernels back (dropping the registration restores them): for a process that goes on after
    evaluating a cell, as a test does."""
    _LIBRARY.clear()


def _mm_into(out: Any, a: Any, b: Any, beta: float = 0.0, bias: Any = None, alpha: float = 1.0) -> Any:
    """out (fp16, [M, N]) = round(beta * bias + alpha * a @ b), the products and sums in fp32, in blocks along
    whichever of N (columns) and K (the reduction) is longer."""
    import torch

    rows, depth = a.shape
    cols = b.shape[1]
    if rows * depth + depth * cols + rows * cols <= BLOCK_ELEMENTS:
        acc = torch.mm(a.float(), b.float())
        if alpha != 1:
            acc.mul_(alpha)
        if bias is not None and beta != 0:
            acc.add_(bias.float(), alpha=beta)
        return out.copy_(acc)
    if cols >= depth:  # a wide product (a head's logits): blocks of columns, each rounded as it lands
        width = max(1, BLOCK_ELEMENTS // (depth + rows))
        wide = a.float()
        for start in range(0, cols, width):
            part = slice(start, start + width)
            acc = torch.mm(wide, b[:, part].float())
            if alpha != 1:
                acc.mul_(alpha)
            if bias is not None and beta != 0:
                acc.add_(bias[:, part].float(), alpha=beta)
            out[:, part].copy_(acc)
        return out
    # a long reduction (the gradient through a head): fp32 partial sums over blocks of K, rounded once at the end
    depth_block = max(1, BLOCK_ELEMENTS // (rows + cols))
    acc = torch.zeros(rows, cols, dtype=torch.float32)
    for start in range(0, depth, depth_block):
        part = slice(start, start + depth_block)
        acc.addmm_(a[:, part].float(), b[part].float())
    if alpha != 1:
        acc.mul_(alpha)
    if bias is not None and beta != 0:
        acc.add_(bias.float(), alpha=beta)
    return out.copy_(acc)


def install() -> None:
    """fp16 mm/addmm/bmm/baddbmm on the CPU with fp32 accumulation, for the rest of this process."""
    if _LIBRARY:
        return
    import torch

    half = torch.float16

    def mm(a: Any, b: Any) -> Any:
        out = a.new_empty((a.shape[0], b.shape[1]))
        if a.dtype == half and b.dtype == half:
            return _mm_into(out, a, b)
        return torch.ops.aten.mm.out(a, b, out=out)

    def addmm(bias: Any, a: Any, b: Any, *, beta: float = 1, alpha: float = 1) -> Any:
        out = a.new_empty((a.shape[0], b.shape[1]))
        if a.dtype == half and b.dtype == half:
            return _mm_into(out, a, b, beta, bias.expand(out.shape), alpha)
        return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)

    def bmm(a: Any, b: Any) -> Any:
        out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
        if a.dtype == half and b.dtype == half:
            if a.numel() + b.numel() + out.numel() <= BLOCK_ELEMENTS:
                return out.copy_(torch.bmm(a.float(), b.float()))
            for i in range(a.shape[0]):
                _mm_into(out[i], a[i], b[i])
            return out
        return torch.ops.aten.bmm.out(a, b, out=out)

    def baddbmm(bias: Any, a: Any, b: Any, *, beta: float = 1, alpha: float = 1) -> Any:
        out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
        if a.dtype == half and b.dtype == half:
            wide = bias.expand(out.shape)
            for i in range(a.shape[0]):
                _mm_into(out[i], a[i], b[i], beta, wide[i], alpha)
            return out
        return torch.ops.aten.baddbmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is replaced: that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in (("mm", mm), ("addmm", addmm), ("bmm", bmm), ("baddbmm", baddbmm)):
            library.impl(name, kernel, "CPU")
    _LIBRARY.append(library)
