"""The skinny (decode and verify) GEMM of outrider.kernels.gemm against torch, and ops.linear's dispatch to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider.kernels import ops

HAVE_CUDA = torch.cuda.is_available()

# Small blocks so that the shapes below take several K steps and partial N and K tiles (and the interpreter
# stays fast), plus the default table's picks.
SMALL = dict(block_n=4, block_k=64)
SHAPES = [(1, 1, 1, False), (1, 37, 200, True), (2, 64, 1000, False), (2, 100, 64, True), (1, 17, 130, False),
          (2, 129, 520, True), (1, 48, 33, True), (2, 70, 250, False)]  # (M, N, K, bias)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(m, n, k, dtype, bias, device):
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)  # outputs ~N(0, 1): one tolerance for all K
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return [t.to(device) if t is not None else None for t in (x, w, b)]


def _check(y, x, w, b):
    """Against fp32 torch on the same rounded inputs, the result rounded once to the input dtype."""
    ref = F.linear(x.float().cpu(), w.float().cpu(), b.float().cpu() if b is not None else None).to(x.dtype)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[x.dtype]
    assert y.shape == ref.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.float().cpu(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["small", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("m,n,k,bias", SHAPES)
def test_skinny_gemm_matches_torch(m, n, k, bias, dtype, kind, device):
    from outrider.kernels import gemm

    config = gemm.GemmConfig(**SMALL) if kind == "small" else None
    x, w, b = _inputs(m, n, k, dtype, bias, device)
    _check(gemm.skinny_gemm(x, w, b, config), x, w, b)


@pytest.mark.parametrize("kind", ["small", "default"])
@pytest.mark.parametrize("m,n,k,bias", SHAPES)
def test_skinny_gemm_silu_mul_matches_torch(m, n, k, bias, model_dtype, kind, device):
    """x = the packed gate_up [M, 2K]: the kernel's product equals F.linear(torch's silu(gate) * up, W).

    model_dtype has bf16 on CUDA only: the interpreter truncates casts to bf16, biasing the activation over K."""
    from outrider.kernels import gemm

    config = gemm.GemmConfig(**SMALL) if kind == "small" else None
    _, w, b = _inputs(m, n, k, model_dtype, bias, device)
    gate_up = (2 * torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(k))).to(model_dtype)
    act = ops.torch_silu_mul(*gate_up.chunk(2, dim=-1))  # rounded to dtype, as the unfused path stores it
    _check(gemm.skinny_gemm(gate_up.to(device), w, b, config, silu_mul=True), act, w, b)


@pytest.mark.parametrize("kind", ["small", "default"])
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add+norm"])
@pytest.mark.parametrize("m,n,k,bias", SHAPES)
def test_skinny_gemm_norm_matches_torch(m, n, k, bias, add, model_dtype, kind, device):
    """x = RMSNorm(x [+ residual]) * norm weight inside the kernel, in float32 (not rounded to the model dtype
    in between, unlike the unfused path): equals the exact product rounded once, and the stored sum equals
    torch's x + residual exactly."""
    from outrider.kernels import gemm

    config = gemm.GemmConfig(**SMALL) if kind == "small" else None
    x, w, b = _inputs(m, n, k, model_dtype, bias, device)
    gen = torch.Generator().manual_seed(n)
    residual = torch.randn(m, k, generator=gen).to(model_dtype).to(device) if add else None
    nw = (1 + torch.randn(k, generator=gen) / 4).to(model_dtype).to(device)
    summed = (x + residual if add else x).cpu()
    h = summed.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double().cpu()
    ref = F.linear(normed, w.double().cpu(), b.double().cpu() if bias else None).to(model_dtype)
    out = torch.empty_like(x) if add else None
    y = gemm.skinny_gemm(x, w, b, config, norm=gemm.RowNorm(nw, 1e-6, residual, out))
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[model_dtype]
    torch.testing.assert_close(y.float().cpu(), ref.float(), rtol=tol, atol=tol)
    if add:
        assert torch.equal(out.cpu(), summed)


@pytest.mark.parametrize("m", [3, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k,bias", [(64, 128, False), (37, 200, True), (192, 640, True), (130, 129, False)])
def test_tensor_core_rows_match_torch(m, n, k, bias, dtype, device):
    """Verify rows (3-16) on the swapped tensor-core kernel: whole and partial tiles of W's rows and of K."""
    from outrider.kernels import gemm

    x, w, b = _inputs(m, n, k, dtype, bias, device)
    _check(gemm.skinny_gemm(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_skinny_gemm_float32_output_keeps_the_float32_accumulator(m, device):
    """out_dtype float32 (LM heads): the product's float32 sum, not rounded to the model dtype first, as cuBLAS's
    mm(out_dtype=float32) gives verify rows (ops.linear), so decode and verify rows break near-ties alike."""
    from outrider.kernels import gemm

    x, w, _ = _inputs(m, 300, 256, torch.float16, False, device)
    y = gemm.skinny_gemm(x, w, out_dtype=torch.float32)
    want = x.float().cpu() @ w.float().cpu().t()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(y.to(torch.float16).float(), y)  # (rounded to fp16 first, it would be representable)
    buffer = torch.full((m + 2, 300), float("nan"), device=device)  # out=: the first rows of a larger buffer
    into = gemm.skinny_gemm(x, w, out_dtype=torch.float32, out=buffer[:m])
    assert into.data_ptr() == buffer.data_ptr() and torch.equal(into, y) and buffer[m:].isnan().all()


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_linear_is_the_unfused_composition_off_cuda(residual, monkeypatch):
    x, w, b = _inputs(2, 40, 64, torch.float32, True, "cpu")
    r = torch.randn(2, 64) if residual else None
    nw = torch.rand(64) + 0.5
    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    with ops.graph_capture():
        y, summed = ops.rms_norm_linear(x, r, nw, 1e-6, w, b)
    normed, ref_sum = ops.torch_rms_norm(x, nw, 1e-6, r)
    assert torch.equal(y, F.linear(normed, w, b))
    assert torch.equal(summed, ref_sum if residual else x)


@pytest.mark.cuda_only
@pytest.mark.parametrize("m", [1, 2, 3])
def test_rms_norm_linear_dispatch_on_cuda(m, monkeypatch):
    """One fused kernel inside graph capture at M <= 2 (with PDL on Hopper), else rms_norm, then the projection
    (on the tensor-core kernel in bfloat16)."""
    from outrider.kernels import gemm

    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    x, w, b = _inputs(m, 96, 256, torch.bfloat16, True, "cuda")
    r, nw = torch.randn_like(x), torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5
    normed, ref_sum = ops.rms_norm(x, nw, 1e-6, r)
    ref = F.linear(normed, w, b)
    y, summed = ops.rms_norm_linear(x, r, nw, 1e-6, w, b)
    assert torch.equal(y, ref) and torch.equal(summed, ref_sum)  # eager: unfused
    calls = []
    real = gemm.skinny_gemm
    monkeypatch.setattr(gemm, "skinny_gemm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with ops.graph_capture():
        y, summed = ops.rms_norm_linear(x, r, nw, 1e-6, w, b)
    assert [kw.get("norm") is not None for kw in calls] == [m <= 2]
    if calls:
        assert calls[0]["pdl"] == (torch.cuda.get_device_capability()[0] >= 9)
    assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=8e-3)


def test_every_candidate_and_default_config(device):
    """What `bench kernels` times and what the table picks are all correct (fp16: one shape, every M)."""
    from outrider.kernels import gemm

    for m in range(1, gemm.MAX_M + 1):
        x, w, b = _inputs(m, 40, 600, torch.float16, True, device)
        for config in {*gemm.candidates(m), gemm.default_config(40, m), gemm.default_config(1 << 20, m)}:
            _check(gemm.skinny_gemm(x, w, b, config), x, w, b)


def test_default_table_covers_every_decode_shape():
    from outrider.kernels import gemm

    for m in range(1, gemm.FMA_MAX_M + 1):
        for n, k in ((1, 1), (1024, 3072), (151936, 4096), (1 << 20, 1 << 20)):
            assert gemm.fits(gemm.default_config(n), m)


def test_linear_keeps_f_linear_off_cuda_and_when_off(monkeypatch):
    x, w, b = _inputs(3, 40, 64, torch.float32, True, "cpu")
    for on in (False, True):
        monkeypatch.setattr(ops, "SKINNY_GEMM", on)
        assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.cuda_only
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_linear_dispatch_on_cuda(m, monkeypatch):
    from outrider.kernels import gemm

    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    calls = []
    monkeypatch.setattr(gemm, "skinny_gemm", lambda *a, **kw: calls.append(a) or F.linear(*a))
    x, w, b = _inputs(m, 96, 256, torch.bfloat16, True, "cuda")
    ops.linear(x, w, b)  # eager: cuBLAS (a Triton launch costs more host time)
    assert not calls
    with ops.graph_capture():
        ops.linear(x, w, b)
        ops.linear(x[:, :128], w[:, :128], b)  # a strided x stays on cuBLAS
    assert len(calls) == 1  # (bfloat16: up to 16 rows)
    with ops.graph_capture():
        ops.linear(x.float(), w.float(), b.float())  # float32 past two rows stays on cuBLAS (tl.dot: TF32)
    assert len(calls) == 1 + (m <= 2)


def test_silu_mul_linear_is_the_unfused_composition_off_cuda(monkeypatch):
    gate_up = torch.randn(2, 2 * 64)
    _, w, b = _inputs(2, 40, 64, torch.float32, True, "cpu")
    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    with ops.graph_capture():
        out = ops.silu_mul_linear(gate_up, w, b)
    assert torch.equal(out, F.linear(ops.torch_silu_mul(*gate_up.chunk(2, dim=-1)), w, b))


@pytest.mark.cuda_only
@pytest.mark.parametrize("m", [1, 2, 3])
def test_silu_mul_linear_dispatch_on_cuda(m, monkeypatch):
    """Inside graph capture the fused skinny kernel at M <= 2, else silu_mul, then the projection."""
    from outrider.kernels import gemm

    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    gate_up = torch.randn(m, 2 * 256, device="cuda", dtype=torch.bfloat16)
    _, w, b = _inputs(m, 96, 256, torch.bfloat16, True, "cuda")
    ref = F.linear(ops.silu_mul(*gate_up.chunk(2, dim=-1)), w, b)
    assert torch.equal(ops.silu_mul_linear(gate_up, w, b), ref)  # eager: unfused
    calls = []
    real = gemm.skinny_gemm
    monkeypatch.setattr(gemm, "skinny_gemm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with ops.graph_capture():
        out = ops.silu_mul_linear(gate_up, w, b)
    assert [kw.get("silu_mul", False) for kw in calls] == [m <= 2]
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=8e-3)


@pytest.mark.cuda_only
def test_cuda_graph_replay_equals_eager():
    """Capture needs no host sync, and replays pick up new inputs in the static buffers."""
    from outrider.kernels import gemm

    x, w, b = _inputs(2, 1000, 768, torch.bfloat16, True, "cuda")
    gemm.skinny_gemm(x, w, b)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm.skinny_gemm(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _check(y, x, w, b)


@pytest.mark.cuda_only
@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["first-tile", "whole"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("late", [False, True], ids=["early-release", "late-release"])
def test_pdl_launch_with_weight_prefetch_equals_eager(budget, norm, late, monkeypatch):
    """Captured with PDL (Hopper), each variant of the weight prefetch before the wait, with the next kernel
    released at the start or after the main loop, gives the eager result."""
    from outrider.kernels import gemm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9")
    monkeypatch.setattr(gemm, "GEMM_PREFETCH_BYTES", budget)
    monkeypatch.setattr(gemm, "GEMM_LATE_RELEASE_BYTES", 0 if late else 2**62)
    x, w, b = _inputs(2, 1000, 768, torch.bfloat16, True, "cuda")
    r = torch.randn_like(x)
    nw = torch.rand(768, device="cuda", dtype=torch.bfloat16) + 0.5

    def run(pdl):
        row_norm = gemm.RowNorm(nw, 1e-6, r, torch.empty_like(x)) if norm else None
        return gemm.skinny_gemm(x, w, b, norm=row_norm, pdl=pdl), row_norm

    eager, eager_norm = run(False)
    run(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, row_norm = run(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    if norm:
        assert torch.equal(row_norm.summed, eager_norm.summed)


@pytest.mark.cuda_only
def test_model_with_skinny_gemm_equals_cpu_reference(tiny_checkpoint, monkeypatch):
    """Greedy tokens of a tiny model through CUDA graphs with every projection on the kernel match the CPU."""
    from outrider.llm import LLM
    from outrider.params import SamplingParams

    path = tiny_checkpoint("qwen3", hidden_size=128, layers=3, heads=4, kv_heads=2, head_dim=32,
                           dtype=torch.float32)
    prompts, params = [[5, 17, 42, 99, 7], [300, 301]], SamplingParams(max_tokens=16, temperature=0.0,
                                                                       ignore_eos=True)

    def greedy(device):
        llm = LLM(str(path), device=device, dtype="float32", block_size=16)
        return [c.token_ids for c in llm.generate(prompts, params)]

    cpu = greedy("cpu")
    monkeypatch.setattr(ops, "SKINNY_GEMM", True)
    assert greedy("cuda") == cpu
