"""The MoE gate's routing kernels (model/kernels/route.py) against the torch form, in Triton's interpreter: the same
experts in the same (ascending) order — ties to the lower id included —, weights within fp32 rounding."""

import pytest
import torch
from kernel_cases import generator

from model import kernels
from model.kernels.route import moe_route_triton


def gate_case(rows: int, C: int, E: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = generator(seed)
    x = torch.randn(rows, C, generator=g).to(dtype)
    weight = torch.randn(E, C, generator=g) / C**0.5
    bias = torch.randn(E, generator=g) * 0.1
    return x, weight, bias


@pytest.mark.parametrize(
    ("rows", "C", "E", "topk", "norm"),
    [(1, 64, 16, 4, True), (37, 96, 24, 6, True), (5, 128, 8, 1, False), (20, 64, 70, 8, True), (3, 32, 4, 4, False)],
)
def test_routing_matches_the_torch_form(rows: int, C: int, E: int, topk: int, norm: bool) -> None:
    x, weight, bias = gate_case(rows, C, E, seed=rows * E + topk)
    want_w, want_ids = kernels.moe_route(x, weight, bias, topk, norm, 2.5, backend="torch")
    got_w, got_ids = kernels.moe_route(x, weight, bias, topk, norm, 2.5, backend="triton")
    assert got_ids.dtype == want_ids.dtype
    assert got_w.dtype == want_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("rows", "C", "splits"), [(1, 192, 3), (19, 320, 2), (4, 100, 2)])
def test_routing_split_over_the_channels_matches_the_torch_form(rows: int, C: int, splits: int) -> None:
    """The gate's K split into partial logits (as on a GPU with few row blocks), added back before √softplus."""
    x, weight, bias = gate_case(rows, C, 40, seed=C + splits)
    want_w, want_ids = kernels.moe_route(x, weight, bias, 6, True, 2.5, backend="torch")
    got_w, got_ids = moe_route_triton(x, weight, bias, 6, True, 2.5, splits=splits)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_tied_scores_choose_the_lower_ids() -> None:
    """Rows whose gate scores tie (equal gate rows: equal scores bit for bit) choose as the stable sort does."""
    x, weight, bias = gate_case(9, 64, 12, seed=5)
    weight[6:] = weight[:6]  # experts e and e + 6 score alike
    bias.zero_()
    want = kernels.moe_route(x, weight, bias, 5, True, 1.0, backend="torch")
    got = kernels.moe_route(x, weight, bias, 5, True, 1.0, backend="triton")
    assert torch.equal(got[1], want[1])
    assert bool((got[1] < 6).sum(1).ge(3).all())  # of each tied pair, the lower id goes first
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_routing_names_bad_arguments() -> None:
    x, weight, bias = gate_case(2, 32, 8, seed=1)
    with pytest.raises(ValueError, match="gate weight"):
        kernels.moe_route(x, weight[:, :-1], bias, 2, True, 1.0, backend="triton")
    with pytest.raises(ValueError, match="topk"):
        kernels.moe_route(x, weight, bias, 9, True, 1.0, backend="triton")
    with pytest.raises(ValueError, match="gate bias"):
        kernels.moe_route(x, weight, bias[:-1], 2, True, 1.0, backend="triton")
