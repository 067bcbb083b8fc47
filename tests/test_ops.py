"""kernels/ops.py's dispatch where it needs no GPU (the kernels' own tests: tests/gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider.kernels import ops

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_writes_a_column_slice_of_a_wider_output_in_place(dtype, bias, device):
    """A product given `out` as columns of a wider row-major output (a packed projection's part, as the quantized
    prefill path writes them) fills those columns with F.linear's result in place and leaves the others."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((70, 64), (48, 64), (48,)))
    b = b if bias else None
    y = torch.zeros(70, 100, dtype=dtype, device=device)
    assert ops.linear(x, w, b, out=y[:, 30:78]).data_ptr() == y[:, 30:78].data_ptr()
    torch.testing.assert_close(y[:, 30:78], F.linear(x, w, b))
    assert not y[:, :30].any() and not y[:, 78:].any()
