"""GPU tests: every test here is marked `gpu` and skipped unless CUDA is available.

With TRITON_INTERPRET=1 (and Triton installed) the kernel tests also run on the CPU through Triton's
interpreter, which is how the kernels were first checked without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from outrider.attention import AttentionMetadata

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
HAVE_CUDA = torch.cuda.is_available()


def _interpret_one_element_blocks_as_indices() -> None:
    """Triton 3.6's interpreter turns a tensor into an index with int() of its numpy array, which numpy refuses for
    the one-element blocks that program ids and values made from them are there: every kernel looping over
    `tl.range(first, last)` of such bounds (split K, quantize_x's tickets) failed with "only 0-dimensional arrays
    can be converted to Python scalars". Index through the single element instead."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _interpret_one_element_blocks_as_indices()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs CUDA (or TRITON_INTERPRET=1 for kernel tests)")
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        item.add_marker(pytest.mark.gpu)
        needs_cuda = item.get_closest_marker("cuda_only") is not None
        if not (HAVE_CUDA or (INTERPRET and not needs_cuda)):
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_only: needs a real CUDA device even under TRITON_INTERPRET")


# Triton's interpreter computes bf16 dots wrongly and truncates casts to bf16 rather than rounding them (numpy has
# no bf16), so it checks the fp16 path instead.
HALF_DTYPES = [torch.bfloat16, torch.float16] if HAVE_CUDA else [torch.float16]


@pytest.fixture(params=HALF_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def half(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=[torch.float32, *HALF_DTYPES], ids=lambda d: str(d).removeprefix("torch."))
def model_dtype(request) -> torch.dtype:
    """float32 and the half dtypes that this run checks (see HALF_DTYPES)."""
    return request.param


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAVE_CUDA else "cpu")


def make_meta(q_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int, device: torch.device,
              causal: bool = True, gen: torch.Generator | None = None,
              max_seq_len: int | None = None) -> tuple[AttentionMetadata, int]:
    """A ragged batch with shuffled (non-contiguous) block tables. Returns (meta, total query tokens)."""
    width = max(1, max(-(-n // block_size) for n in seq_lens))
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays the padding target
    need = sum(-(-n // block_size) for n in seq_lens)
    assert need <= num_blocks - 1, "test pool too small"
    tables, slots, used = [], [], 0
    for q_len, n in zip(q_lens, seq_lens):
        nb = -(-n // block_size)
        blocks = perm[used:used + nb].tolist()
        used += nb
        tables.append(blocks + [0] * (width - nb))
        for p in range(n - q_len, n):
            slots.append(blocks[p // block_size] * block_size + p % block_size if p >= 0 else -1)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max_seq_len if max_seq_len is not None else max(seq_lens),
        causal=causal,
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
    )
    return meta, qsl[-1]
