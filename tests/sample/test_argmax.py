"""first_argmax (sample/argmax.py) and the CPU platform's one-call kernel for it (kernels/csrc/elementwise.cpp,
float32 logits) give torch.argmax's index for every input: ties, NaN, -inf, vocabularies that are and
are not a multiple of a block or a vector, one row and many."""
from __future__ import annotations

import pytest
import torch

from twostep.sample.argmax import BLOCK, first_argmax


def kernel_argmax(x: torch.Tensor) -> torch.Tensor:
    from twostep.kernels import elementwise

    kernel = elementwise()
    if kernel is None:
        pytest.skip("the elementwise kernel cannot be built here (no g++ or ninja)")
    # float32 only (the sampler's logits); the rest keep sample/argmax.py
    return kernel.first_argmax(x) if x.dtype == torch.float32 else first_argmax(x)


@pytest.fixture(params=["torch-ops", "kernel"])
def argmax(request):
    return first_argmax if request.param == "torch-ops" else kernel_argmax


@pytest.fixture
def check(argmax):
    def check(x: torch.Tensor) -> None:
        assert torch.equal(argmax(x), x.argmax(dim=-1))
    return check


@pytest.mark.parametrize("vocab", [1, 7, 31, 33, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 49152, 151936, 1000])
@pytest.mark.parametrize("rows", [1, 3])
def test_random_rows(vocab, rows, check):
    g = torch.Generator().manual_seed(vocab * 10 + rows)
    check(torch.randn(rows, vocab, generator=g))


def test_ties_go_to_the_first_occurrence(check):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (6, 5 * BLOCK + 17), generator=g).float()   # the maximum many times over
    check(x)
    x = torch.full((4, 3 * BLOCK + 5), -float("inf"))                     # all equal: index 0
    check(x)
    x[1, -1] = 0.0                                                        # the last position only
    x[2, BLOCK - 1] = x[2, BLOCK] = 1.0                                   # across a block boundary
    x[3, 3 * BLOCK:] = 2.0                                                # the short last block
    check(x)


def test_nan_is_the_largest_as_torch_takes_it(check):
    x = torch.randn(3, 4 * BLOCK + 3)
    x[0, 700] = float("nan")
    x[0, 900] = float("nan")
    x[1, -2] = float("nan")
    x[2, 5] = float("inf")
    x[2, 6] = float("nan")
    check(x)
    y = torch.zeros(2, 37)
    y[0, 36] = float("nan")                  # in the tail after the vectors
    y[1, :] = float("nan")
    check(y)


def test_signed_zeros_and_infinities(check):
    x = torch.full((3, 70), -1.0)
    x[0, 40], x[0, 41] = -0.0, 0.0           # equal: the first
    x[1, 3], x[1, 69] = float("inf"), float("inf")
    x[2, :] = -float("inf")
    check(x)


def test_views_and_dtypes(check):
    x = torch.randn(5, 3 * BLOCK + 9)
    check(x[1:4])                        # a slice of rows
    check(x[::2])                        # strided rows
    check(x.double())
    check(x.bfloat16())
    check(torch.randint(0, 50, (2, 3 * BLOCK)))   # integers keep torch.argmax
    check(torch.randn(0, 3 * BLOCK))              # no rows
