"""A CPU fp16 cell's matmuls (cell/nonfinite/fp16_matmul.py): fp16 operands, fp32 products and sums, one rounding to
fp16, in blocks that keep the fp32 copies small. Checked in a child process (the kernels are replaced for the whole
process): every product, in each of its three block paths, is the fp64 product rounded to fp16 within the fp32
sums' error, and within one fp16 step of torch's own fp16 kernels; other dtypes still run torch's kernels, to the
bit; a linear layer's backward gives torch's gradients. The plan turns it on for CPU fp16 cells only."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tunegrid.prepare.cpu_kernels import cpu_fp16_matmul

CHILD = textwrap.dedent(
    """
    import torch
    from tunegrid.cell.nonfinite import fp16_matmul

    torch.manual_seed(0)
    H = torch.float16

    def close(got, want64, name):
        # the fp64 product rounded to fp16, give or take one fp16 step: fp32 sums differ from fp64 ones by far less
        want = want64.to(H).double()
        step = torch.finfo(H).eps * want.abs().clamp_min(torch.finfo(H).tiny)
        bad = ((got.double() - want).abs() > step * 1.01).sum().item()
        assert got.dtype == H and bad == 0, (name, bad)

    def cases():
        a, b = torch.randn(6, 40), torch.randn(40, 300)  # wide: column blocks
        yield "wide", a.to(H), b.to(H)
        a, b = torch.randn(6, 500), torch.randn(500, 30)  # a long reduction: blocks of K
        yield "deep", a.to(H), b.to(H)
        a, b = torch.randn(3, 8), torch.randn(8, 5)  # one block
        yield "small", a.to(H), b.to(H)

    products = list(cases())
    native = {name: a @ b for name, a, b in products}  # torch's own fp16 kernels
    x32, w32 = torch.randn(7, 33), torch.randn(33, 9)
    before = {dt: x32.to(dt) @ w32.to(dt) for dt in (torch.float32, torch.bfloat16)}
    layer = torch.nn.Linear(33, 9, bias=False).to(H)
    inp = torch.randn(4, 7, 33).to(H).requires_grad_()
    layer(inp).float().square().sum().backward()
    torch_grad = inp.grad.clone()

    fp16_matmul.BLOCK_ELEMENTS = 2000  # small blocks, so the shapes above take each path
    calls, blocks = [], fp16_matmul._mm_into
    fp16_matmul._mm_into = lambda *args, **kwargs: (calls.append(args[1].shape), blocks(*args, **kwargs))[1]
    fp16_matmul.install()
    assert fp16_matmul.installed()
    for name, a, b in products:
        close(a @ b, a.double() @ b.double(), f"mm {name}")
        bias = torch.randn(b.shape[1]).to(H)
        got = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
        close(got, 0.5 * bias.double() + 2.0 * (a.double() @ b.double()), f"addmm {name}")
        step = torch.finfo(H).eps * native[name].double().abs().clamp_min(torch.finfo(H).tiny)
        assert ((a @ b).double() - native[name].double()).abs().le(step * 1.01).all(), f"torch's fp16 {name}"
    batch_a, batch_b = torch.randn(3, 6, 500).to(H), torch.randn(3, 500, 30).to(H)
    close(torch.bmm(batch_a, batch_b), torch.bmm(batch_a.double(), batch_b.double()), "bmm")
    bias = torch.randn(3, 6, 30).to(H)
    got = torch.baddbmm(bias, batch_a, batch_b, beta=0.25, alpha=1.5)
    close(got, 0.25 * bias.double() + 1.5 * torch.bmm(batch_a.double(), batch_b.double()), "baddbmm")
    small_a, small_b = torch.randn(2, 3, 4).to(H), torch.randn(2, 4, 5).to(H)
    close(torch.bmm(small_a, small_b), torch.bmm(small_a.double(), small_b.double()), "bmm one block")
    assert len(calls) >= 6, "the fp16 products ran tunegrid's kernels"
    for dt, want in before.items():  # torch's own kernels, untouched
        assert torch.equal(x32.to(dt) @ w32.to(dt), want), dt
    inp.grad = None
    layer(inp).float().square().sum().backward()
    torch.testing.assert_close(inp.grad, torch_grad, rtol=2e-3, atol=2e-3)
    print("checked")
    """
)


def test_fp16_products_sum_in_fp32_round_once_and_leave_other_dtypes_alone():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize(
    ("precision", "device", "on"),
    [("fp16", "cpu", True), ("fp16-residual", "cpu", True), ("fp16", "cuda", False), ("bf16", "cpu", False)],
)
def test_the_plan_sums_fp16_matmuls_in_fp32_on_a_cpu_only(precision, device, on):
    from conftest import one_cell_spec

    reason = cpu_fp16_matmul(one_cell_spec(precision=precision), device)
    assert (reason is not None) == on
