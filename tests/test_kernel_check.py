"""The kernel-check stage: the four-number example and the elementwise criterion, and that they fail
for a wrong operator."""

from __future__ import annotations

import pytest
import torch

from lrattnres.kernel_check import compare, four_number_example, validate_spec
from lrattnres.routing import route


def test_four_number_example_holds_for_the_reference():
    assert four_number_example(lambda s, q: route(s, q, norm="slice", eps=0.0)) < 1e-12


def test_four_number_example_catches_a_wrong_operator():
    # full-width normalisation is a different function: the example must notice
    assert four_number_example(lambda s, q: route(s, q, norm="full", eps=0.0)) > 0.1


def test_compare_reference_with_itself_passes_and_a_bad_gradient_fails():
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(8, 24, generator=gen) for _ in range(4)]
    query = torch.randn(6, generator=gen)
    ok = compare(route, sources, query, "slice")
    assert ok["finite"] and ok["criterion_max"] < 1e-4 and ok["rel_query_grad"] < 1e-5

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, *srcs):
            return route(list(srcs), q).detach()

        @staticmethod
        def backward(ctx, g):
            return (None, *[2 * g for _ in range(ctx.needs_input_grad.__len__() - 1)])

    def wrong(srcs, q, norm, eps):
        return Wrong.apply(q, *srcs)

    bad = compare(wrong, sources, query, "slice")
    assert bad["criterion_max"] > 1 or not bad["finite"]


def test_spec_errors_name_the_key():
    with pytest.raises(ValueError, match="'casez'"):
        validate_spec({"casez": []})
    with pytest.raises(ValueError, match=r"cases\[0\]"):
        validate_spec({"cases": [{"d": 8}]})
    with pytest.raises(ValueError, match="norm"):
        validate_spec({"cases": [{"d": 8, "r": "d", "S": 2, "tokens": 4, "norm": "rms"}]})
