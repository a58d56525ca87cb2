"""The reference depth routing against the paper's equations and the explainer's worked examples."""

import math

import pytest
import torch

from lrattnres.routing import SourceBank, block_ends, rms_norm, route, route_keys, routing_scores


def test_four_number_example():
    """Explainer: d=4, r=2, keys (1,0) and (0,1), q=(log3/sqrt2, 0) -> weights (3/4, 1/4)."""
    o_a = torch.tensor([4.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    o_b = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    q = torch.tensor([math.log(3) / math.sqrt(2), 0.0], dtype=torch.float64)
    h, w = route([o_a, o_b], q, eps=0.0, return_weights=True)
    torch.testing.assert_close(w, torch.tensor([0.75, 0.25], dtype=torch.float64))
    assert h[0].item() == pytest.approx(3.0)

    o_a8 = o_a.clone()
    o_a8[0] = 8.0  # outside the key slice: the router never sees it, the mixture carries it
    h8, w8 = route([o_a8, o_b], q, eps=0.0, return_weights=True)
    torch.testing.assert_close(w8, w)
    assert h8[0].item() == pytest.approx(6.0)
    torch.testing.assert_close(h8[1:], h[1:])


def test_block_ends():
    assert block_ends(6, 3) == [2, 4, 6]
    assert block_ends(48, 8) == [6, 12, 18, 24, 30, 36, 42, 48]
    assert block_ends(8, 3) == [3, 6, 8]  # ceil(8j/3)
    assert block_ends(5, "full") == [1, 2, 3, 4, 5] == block_ends(5, None) == block_ends(5, 5)
    assert block_ends(7, 1) == [7]
    for bad in (0, 9, -1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="num_blocks"):
            block_ends(8, bad)


def test_six_writes_in_three_pairs():
    """Explainer: after write 3 the bank is {o0, o1+o2, o3}; after write 4 {o0, o1+o2, o3+o4}."""
    o = [torch.eye(7)[i] for i in range(7)]  # o_i = e_i, so a sum shows which writes it holds
    bank = SourceBank(o[0], num_writes=6, num_blocks=3)
    seen = []
    for t in range(1, 7):
        bank.write(o[t])
        seen.append([s.nonzero().flatten().tolist() for s in bank.sources()])
    assert seen[2] == [[0], [1, 2], [3]]
    assert seen[3] == [[0], [1, 2], [3, 4]]
    assert seen[5] == [[0], [1, 2], [3, 4], [5, 6]]  # the head's read
    assert seen[0] == [[0], [1]]
    with pytest.raises(ValueError, match="num_writes"):
        bank.write(o[0])


def test_full_routing_bank_keeps_every_write():
    o = [torch.eye(5)[i] for i in range(5)]
    bank = SourceBank(o[0], num_writes=4, num_blocks="full")
    for t in range(1, 5):
        bank.write(o[t])
        assert len(bank.sources()) == t + 1
    torch.testing.assert_close(torch.stack(bank.sources()), torch.eye(5))


def _standard_attnres(sources, q, eps):
    """Standard AttnRes: softmax_i(q . RMSNorm(o_i)) over the full width."""
    v = torch.stack(sources)
    w = (rms_norm(v, eps) @ q).softmax(0)
    return (w[..., None] * v).sum(0), w


@pytest.mark.parametrize("norm", ["slice", "full"])
def test_rank_d_is_standard_attnres(norm):
    torch.manual_seed(0)
    d = 8
    sources = [torch.randn(3, 5, d, dtype=torch.float64) * (i + 1) for i in range(4)]
    q = torch.randn(d, dtype=torch.float64)
    h, w = route(sources, q, norm=norm, eps=1e-6, return_weights=True)
    h_ref, w_ref = _standard_attnres(sources, q, 1e-6)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(w, w_ref)


def test_zero_query_gives_uniform_weights():
    torch.manual_seed(0)
    sources = [torch.randn(2, 3, 16) for _ in range(5)]
    for norm in ("slice", "full"):
        h, w = route(sources, torch.zeros(4), norm=norm, return_weights=True)
        torch.testing.assert_close(w, torch.full_like(w, 0.2))
        torch.testing.assert_close(h, torch.stack(sources).mean(0))


def test_slice_and_full_rms_differ_only_through_the_outside_norm():
    """Same tail, different head coordinates: slice scores agree, full-width-RMS scores do not."""
    d, r = 6, 2
    tail = torch.tensor([1.0, 2.0], dtype=torch.float64)
    o1 = torch.cat([torch.zeros(d - r, dtype=torch.float64), tail])
    o2 = torch.cat([torch.full((d - r,), 5.0, dtype=torch.float64), tail])
    q = torch.tensor([2.0, 1.0], dtype=torch.float64)
    s_slice = routing_scores([o1, o2], q, norm="slice", eps=1e-6)
    s_full = routing_scores([o1, o2], q, norm="full", eps=1e-6)
    assert s_slice[0] == pytest.approx(s_slice[1].item())
    assert s_full[0] - s_full[1] > 1.0  # the big head coordinates shrink o2's full-width key
    # with r = d the two normalisations are the same function
    torch.manual_seed(1)
    sources = [torch.randn(4, d, dtype=torch.float64) for _ in range(3)]
    qd = torch.randn(d, dtype=torch.float64)
    torch.testing.assert_close(route(sources, qd, norm="slice"), route(sources, qd, norm="full"))


def test_block_sum_first_then_slice_then_normalise():
    """A block's key is RMSNorm(tail_r(o_a + o_b)), not a combination of the writes' own keys."""
    torch.manual_seed(0)
    d, r = 8, 3
    o0, o1, o2 = (torch.randn(d, dtype=torch.float64) for _ in range(3))
    bank = SourceBank(o0, num_writes=2, num_blocks=1)
    bank.write(o1)
    bank.write(o2)
    q = torch.randn(r, dtype=torch.float64)
    z = routing_scores(bank.sources(), q, norm="slice", eps=1e-6)
    assert z[1].item() == pytest.approx((rms_norm((o1 + o2)[-r:], 1e-6) @ q).item())


def test_route_keys_matches_slice_route_when_keys_are_the_slices():
    torch.manual_seed(0)
    d, r = 10, 4
    values = [torch.randn(2, 3, d) for _ in range(4)]
    q = torch.randn(r)
    h, w = route_keys(values, [v[..., -r:] for v in values], q, eps=1e-6, return_weights=True)
    h_ref, w_ref = route(values, q, norm="slice", eps=1e-6, return_weights=True)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(w, w_ref)
    with pytest.raises(ValueError, match="one key per value"):
        route_keys(values, values[:2], q)


def test_route_keeps_dtype_and_computes_weights_in_fp32():
    sources = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(3)]
    h, w = route(sources, torch.randn(4), return_weights=True)
    assert h.dtype == torch.bfloat16 and w.dtype == torch.float32


def test_bad_route_input():
    s = [torch.randn(4, 8)]
    with pytest.raises(ValueError, match="norm"):
        route(s, torch.randn(4), norm="layer")
    with pytest.raises(ValueError, match="r=9"):
        route(s, torch.randn(9))
    with pytest.raises(ValueError, match="at least one source"):
        route([], torch.randn(4))


# ---- Appendix B.3: local value and routing gradients -------------------------------------------


def test_slice_score_gradient_lives_in_the_slice():
    """Corollary 2.1: with slice normalisation grad_o z is zero outside the last r coordinates and
    equals q/rho - (q.k) k / (r rho^3) inside; full-width RMS (Corollary 2.2) reaches every coordinate."""
    torch.manual_seed(0)
    d, r, eps = 12, 4, 1e-6
    o = torch.randn(d, dtype=torch.float64, requires_grad=True)
    q = torch.randn(r, dtype=torch.float64)
    (g,) = torch.autograd.grad(routing_scores([o], q, norm="slice", eps=eps)[0], o)
    assert torch.all(g[: d - r] == 0)
    k = o.detach()[-r:]
    rho = torch.sqrt(k.square().mean() + eps)
    torch.testing.assert_close(g[-r:], q / rho - (q @ k) * k / (r * rho**3))

    (g_full,) = torch.autograd.grad(routing_scores([o], q, norm="full", eps=eps)[0], o)
    assert torch.all(g_full[: d - r] != 0)
    od = o.detach()
    rho_d = torch.sqrt(od.square().mean() + eps)
    z = (od[-r:] @ q) / rho_d
    expected = torch.cat([torch.zeros(d - r, dtype=torch.float64), q]) / rho_d - z * od / (d * rho_d**2)
    torch.testing.assert_close(g_full, expected)


@pytest.mark.parametrize("norm", ["slice", "full"])
def test_local_value_jacobian_rank(norm):
    """Corollary 2.3: dh/do_i = alpha_i [I + (o_i - h) grad z_i^T] has rank >= d - 1, not r."""
    torch.manual_seed(0)
    d, r, eps = 8, 2, 1e-6
    sources = [torch.randn(d, dtype=torch.float64) for _ in range(4)]
    q = torch.randn(r, dtype=torch.float64) * 3
    i = 2

    def h_of(oi):
        return route(sources[:i] + [oi] + sources[i + 1 :], q, norm=norm, eps=eps)

    jac = torch.autograd.functional.jacobian(h_of, sources[i])
    assert torch.linalg.matrix_rank(jac) >= d - 1

    oi = sources[i].clone().requires_grad_(True)
    z = routing_scores(sources[:i] + [oi] + sources[i + 1 :], q, norm=norm, eps=eps)
    (grad_z,) = torch.autograd.grad(z[i], oi)
    h, w = route(sources, q, norm=norm, eps=eps, return_weights=True)
    lemma = w[i] * (torch.eye(d, dtype=torch.float64) + torch.outer(sources[i] - h, grad_z))
    torch.testing.assert_close(jac, lemma)
