"""Crescent's CPU linears (common/model/cpu_linear.py), bfloat16 and float32: torch's
result on the same inputs up to float32 summation order, every row bit for bit the same
alone, in any batch and split over threads, and what ``Linear`` runs each for."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import cpu_linear, native
from common.model.linear import Linear

BF16, F32 = cpu_linear.kernel(torch.bfloat16), cpu_linear.kernel(torch.float32)
needs_bf16 = pytest.mark.skipif(BF16 is None, reason="the CPU bfloat16 linear kernel did not "
                                "build (no C compiler or no AVX-512 BF16): oneDNN serves")
KERNELS = [pytest.param(torch.bfloat16, marks=needs_bf16),
           pytest.param(torch.float32, marks=pytest.mark.skipif(
               F32 is None, reason="the CPU float32 linear kernel did not build (no C "
               "compiler or no AVX-512): oneDNN serves"))]


def _case(n: int, k: int, m: int, seed: int, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g).to(dtype), torch.randn(m, k, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", KERNELS)
@pytest.mark.parametrize("n, k, m", [(576, 576, 1), (960, 576, 3), (3072, 576, 7),
                                     (576, 1536, 32), (48, 20, 5), (100, 33, 13)])
def test_equals_torch_on_the_same_inputs(dtype: torch.dtype, n: int, k: int, m: int) -> None:
    w, x = _case(n, k, m, n + m, dtype)
    if not cpu_linear.PackedLinear.fits(w, dtype):
        assert dtype is torch.bfloat16  # the float32 kernel tiles any shape
        return
    got = cpu_linear.PackedLinear(cpu_linear.kernel(dtype), w, dtype)(x)
    want = F.linear(x.double(), w.double()).float()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("dtype", KERNELS)
def test_rows_do_not_depend_on_the_batch_or_threads(dtype: torch.dtype) -> None:
    # a partial last tile of outputs; rows in three of the float32 kernel's row blocks
    w, x = _case(3008, 576, 2 * cpu_linear.ROW_BLOCK + 5, 7, dtype)
    lin = cpu_linear.PackedLinear(cpu_linear.kernel(dtype), w, dtype)
    batch = lin(x)
    # row tiles of 4, 8 and 4 (bfloat16) or of 6, 8 and 6 (float32): the same sums
    for rows in ([5], [0, 1], [3, 4, 5], list(range(9)), list(range(20, 4, -1)),
                 list(range(36, -1, -1)), list(range(50, 100))):
        assert torch.equal(lin(x[rows]), batch[rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # the outputs split over 3 threads (OpenMP, where built)
        assert torch.equal(lin(x), batch)
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_linear_runs_it_for_bfloat16_linears_of_a_float32_model() -> None:
    """A float32 model's linear in bfloat16 takes the kernel (float32 out, bias added);
    a bfloat16 model's, or a shape it cannot tile keep oneDNN or torch."""
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    lin = Linear(w, bias=bias, dtype=torch.bfloat16)
    assert lin.native is not None and lin.native.dtype is torch.bfloat16
    x = torch.randn(3, 32, generator=g)
    want = F.linear(x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()).float() \
        + bias.to(torch.bfloat16).float()
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-4)
    assert Linear(w.to(torch.bfloat16)).native is None
    assert Linear(torch.randn(60, 32), dtype=torch.bfloat16).native is None


@pytest.mark.skipif(F32 is None, reason="the CPU float32 linear kernel did not build")
def test_linear_runs_the_float32_kernel_for_a_float32_model(monkeypatch) -> None:
    """A float32 linear of any shape takes the float32 kernel (bias added, one row alone);
    off (``CRESCENT_CPU_LINEAR=0``) or unpacked, oneDNN or torch, and the same values."""
    g = torch.Generator().manual_seed(4)
    w, bias, x = (torch.randn(60, 33, generator=g), torch.randn(60, generator=g),
                  torch.randn(5, 33, generator=g))
    lin = Linear(w, bias=bias)
    assert lin.native is not None and lin.native.dtype is torch.float32
    want = (F.linear(x.double(), w.double()) + bias.double()).float()
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x[2:3]), lin(x)[2:3])
    assert Linear(w, pack=False).native is None
    monkeypatch.setenv("CRESCENT_CPU_LINEAR", "0")
    off = Linear(w, bias=bias)
    assert off.native is None
    assert torch.allclose(off(x), want, rtol=1e-5, atol=1e-5)


@needs_bf16
def test_a_native_only_linear_casts_only_onto_the_kernel(monkeypatch) -> None:
    """The lm_head (``native_only``): bfloat16 weights on the kernel, float32 logits; where
    the kernel is off or cannot tile it, float32 weights, never bfloat16-rounded logits."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 32, generator=g), torch.randn(3, 32, generator=g)
    head = Linear(w, dtype=torch.bfloat16, native_only=True)
    assert head.native is not None and head(x).dtype == torch.float32
    untiled = Linear(torch.randn(60, 32, generator=g), dtype=torch.bfloat16, native_only=True)
    assert untiled.native is None and untiled.cast is None
    monkeypatch.setenv("CRESCENT_CPU_LINEAR", "0")
    off = Linear(w, dtype=torch.bfloat16, native_only=True)
    assert off.native is None and off.cast is None
    assert torch.equal(off(x), Linear(w)(x))


@pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels did not build")
def test_the_kernels_split_on_torchs_own_openmp_team() -> None:
    """The library uses the OpenMP runtime torch loaded (one libgomp in the process: a
    second team would spin beside torch's), and a call splits over torch's threads."""
    assert native.library() is not None
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) <= 1, runtimes
    if not native.parallel():
        pytest.skip("the kernels were built without OpenMP: one thread a call")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert (native.threads(10), native.threads(2), native.threads(0)) == (3, 2, 1)
    finally:
        torch.set_num_threads(threads)
