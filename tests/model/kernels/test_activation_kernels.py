"""The per-step activation kernels (FP8 QAT cast, a site's norm and cast, SwiGLU and cast, mHC coefficients) against
their torch forms, in Triton's interpreter, and the rules that keep the torch form where the kernels do not apply
(gradients, fp64)."""

import pytest
import torch
from kernel_cases import generator

from model import kernels, mhc, quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (0, 32), (1, 1, 1, 512)])
def test_fake_quant_fp8_values_are_the_reference_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = generator(shape[-1])
    magnitudes = 2.0 ** torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float()
    x = (torch.randn(shape, generator=g) * magnitudes).to(dtype)
    if x.numel():
        x.view(-1)[0] = -0.0  # −0 keeps its sign
    want = kernels.fake_quant_fp8(x, backend="torch")
    got = kernels.fake_quant_fp8(x, backend="triton")
    assert got.dtype == dtype
    assert got.shape == x.shape
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns about inf and NaN
def test_fake_quant_fp8_saturation_and_specials() -> None:
    """Values past E4M3's 448 × scale cannot occur (the scale is from the block maximum), so saturation is met by
    the amax floor: tiny blocks. inf and NaN blocks give NaN as in the reference (0 × inf)."""
    x = torch.randn(4, 64, generator=generator(7))
    x[0] *= 1e-9  # below the amax floor: the floor's scale, values round to E4M3 subnormals or 0
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    want = kernels.fake_quant_fp8(x, backend="torch")
    got = kernels.fake_quant_fp8(x, backend="triton")
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32))


def test_fake_quant_fp8_passes_the_gradient_straight_through() -> None:
    x = torch.randn(2, 64, generator=generator(8), requires_grad=True)
    y = kernels.fake_quant_fp8(x, backend="triton")
    assert torch.equal(y.detach(), quant.fake_quant_fp8(x.detach()))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).expand(2, 64))


def test_fake_quant_fp8_names_a_bad_width() -> None:
    with pytest.raises(ValueError, match="fake_quant_fp8"):
        kernels.fake_quant_fp8(torch.zeros(2, 48), backend="triton")


def site_case(lead: tuple[int, ...], n: int, C: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """A stream X [*lead, n, C] (or [*lead, C] for n = 0) with its input mix and a norm weight."""
    g = generator(seed)
    X = (torch.randn(*lead, *((n,) if n else ()), C, generator=g) * 3.0).to(dtype)
    pre = (torch.rand(*lead, n, generator=g) + 0.2) if n else None
    return X, pre, torch.rand(C, generator=g).to(dtype) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lead", "n", "C"), [((2, 3), 4, 64), ((5,), 0, 96), ((1, 1), 4, 512), ((0,), 4, 32)])
def test_norm_cast_matches_the_norm_and_casts_what_it_returns(
    lead: tuple[int, ...], n: int, C: int, dtype: torch.dtype
) -> None:
    """The kernel's x is the torch form's up to rounding (one sum order for the mean), and its bytes are exactly the
    FP8 cast of the x it returns, so the linears read the cast of the floats every other reader sees."""
    X, pre, weight = site_case(lead, n, C, dtype, seed=C + n)
    want_x, _, _ = kernels.norm_cast(X, pre, weight, 1e-6, backend="torch")
    x, data, scale = kernels.norm_cast(X, pre, weight, 1e-6, backend="triton")
    assert x.dtype == dtype
    assert x.shape == (*lead, C)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(x, want_x, rtol=tolerance, atol=tolerance)
    want_data, want_scale = quant.fp8_quant(x, 32)
    assert torch.equal(data, want_data)
    assert torch.equal(scale, want_scale)


def test_norm_cast_takes_a_column_view() -> None:
    """c^Q's norm reads wq_a's output, a column view of the stacked wq_a ‖ wkv GEMM, by its row stride: the results
    of the same rows made contiguous."""
    latents, _, weight = site_case((5, 1), 0, 160, torch.float32, seed=9)
    view = latents[..., :96]
    got = kernels.norm_cast(view, None, weight[:96], 1e-6, backend="triton")
    want = kernels.norm_cast(view.contiguous(), None, weight[:96], 1e-6, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_norm_cast_keeps_the_torch_form_for_gradients_and_fp64_and_names_bad_shapes() -> None:
    X, pre, weight = site_case((3,), 4, 64, torch.float64, seed=5)
    x, data, scale = kernels.norm_cast(X, pre, weight, 1e-6, backend="triton")  # fp64: the torch form
    assert x.dtype == torch.float64
    assert all(torch.equal(a, b) for a, b in zip((data, scale), quant.fp8_quant(x, 32), strict=True))
    weight = weight.float().requires_grad_()
    x, _, _ = kernels.norm_cast(X.float(), pre.float(), weight, 1e-6, backend="triton")
    assert x.requires_grad
    with pytest.raises(ValueError, match="pre: expected shape"):
        kernels.norm_cast(X, pre[:, :2], weight, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="weight: expected shape"):
        kernels.norm_cast(X, pre, weight[:32], 1e-6, backend="triton")
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.norm_cast(torch.zeros(2, 48), None, torch.ones(48), 1e-6, backend="triton")


def test_swiglu_cast_reads_column_views_and_casts_the_torch_forms_values() -> None:
    """fp32: the bytes of the torch form exactly. bf16: h rounds once here (the torch form rounds silu first, and the
    interpreter truncates), so the values agree to an E4M3 step."""
    g = generator(11)
    for dtype in (torch.float32, torch.bfloat16):
        y = (torch.randn(6, 2 * 96, generator=g) * 6.0).to(dtype)  # one GEMM's gate ‖ up columns; beyond the limit
        gate, up = y.split(96, dim=1)
        got = kernels.swiglu_cast(gate, up, 10.0, backend="triton")
        want = kernels.swiglu_cast(gate.contiguous(), up.contiguous(), 10.0, backend="torch")
        if dtype == torch.float32:
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            torch.testing.assert_close(quant.fp8_dequant(*got), quant.fp8_dequant(*want), rtol=2.0**-3, atol=1e-3)
    assert kernels.swiglu_cast(torch.zeros(0, 64), torch.zeros(0, 64), 10.0, backend="triton")[0].shape == (0, 64)


def test_swiglu_cast_names_bad_shapes() -> None:
    with pytest.raises(ValueError, match="up: expected shape"):
        kernels.swiglu_cast(torch.zeros(2, 64), torch.zeros(2, 32), 10.0, backend="triton")
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.swiglu_cast(torch.zeros(2, 48), torch.zeros(2, 48), 10.0, backend="triton")


def coefficients_case(lead: tuple[int, ...], n: int, C: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = generator(seed)
    X = (torch.randn(*lead, n, C, generator=g) * 4.0).to(dtype)
    fn = torch.randn((2 + n) * n, n * C, generator=g) / (n * C) ** 0.5 * 3.0
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn((2 + n) * n, generator=g)
    return X, fn, scale, base


@pytest.mark.parametrize(
    ("lead", "n", "C", "iters", "dtype"),
    [((1, 1), 4, 64, 20, torch.bfloat16), ((3, 5), 4, 96, 20, torch.float32), ((37,), 2, 320, 7, torch.bfloat16),
     ((2, 3), 8, 32, 1, torch.float16)],
)  # fmt: skip
def test_hc_coefficients_match_the_torch_form(
    lead: tuple[int, ...], n: int, C: int, iters: int, dtype: torch.dtype
) -> None:
    """Split-K projection (channel counts off the split width included) + split + Sinkhorn against mixes → split."""
    case = coefficients_case(lead, n, C, dtype, seed=n * iters + C)
    want = mhc.hc_split_sinkhorn(mhc.hc_mixes(case[0], case[1], 1e-6), *case[2:], n, iters, 1e-6)
    got = kernels.hc_coefficients(*case, n, iters, 1e-6, 1e-6, backend="triton")
    for g_part, w_part in zip(got, want, strict=True):
        assert g_part.shape == w_part.shape
        assert g_part.dtype == w_part.dtype == torch.float32
        torch.testing.assert_close(g_part, w_part, rtol=2e-5, atol=1e-6)  # fp32 sums in another order only
    assert torch.allclose(got[2].sum(-2), torch.ones(*lead, n), atol=1e-4)  # ends on a column normalisation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lead", "C"), [((3,), 64), ((2, 5), 96), ((1,), 512), ((0,), 64)])
def test_hc_expand_coefficients_match_the_update_then_the_coefficients(
    lead: tuple[int, ...], C: int, dtype: torch.dtype
) -> None:
    """X' = hc_expand(out, X, post, comb) made in the projection's pass: X' within its rounding to X's dtype (the
    interpreter truncates where torch rounds to nearest), and the coefficients those of the X' returned, bit for bit;
    a row's results do not depend on the batch."""
    X, fn, scale, base = coefficients_case(lead, 4, C, dtype, seed=C + len(lead))
    g = generator(C)
    out = torch.randn(*lead, C, generator=g).to(dtype)
    post, comb = torch.rand(*lead, 4, generator=g) * 2.0, torch.rand(*lead, 4, 4, generator=g)
    got = kernels.hc_expand_coefficients(out, X, post, comb, fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    want = kernels.hc_expand_coefficients(out, X, post, comb, fn, scale, base, 4, 20, 1e-6, 1e-6, backend="torch")
    assert got[0].dtype == dtype
    assert got[0].shape == X.shape
    rounding = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=rounding, atol=rounding)
    of_returned = kernels.hc_coefficients(got[0], fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got[1:], of_returned, strict=True))
    if lead[0] > 1:
        alone = kernels.hc_expand_coefficients(
            out[:1], X[:1], post[:1], comb[:1], fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton"
        )
        assert all(torch.equal(a[0], b[0]) for a, b in zip(alone, got, strict=True))


def test_hc_expand_coefficients_name_bad_shapes() -> None:
    X, fn, scale, base = coefficients_case((2,), 4, 32, torch.float32, seed=5)
    out, post, comb = torch.zeros(2, 32), torch.zeros(2, 4), torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="out: expected shape"):
        kernels.hc_expand_coefficients(out[:, :16], X, post, comb, fn, scale, base, 4, 20, 1e-6, 1e-6, "triton")
    with pytest.raises(ValueError, match="comb: expected shape"):
        kernels.hc_expand_coefficients(out, X, post, comb[..., :2], fn, scale, base, 4, 20, 1e-6, 1e-6, "triton")


def test_hc_coefficients_of_a_row_do_not_depend_on_the_batch() -> None:
    """The split count follows the channel count alone: a row's coefficients are the same bits in a batch of 1 or 40."""
    X, fn, scale, base = coefficients_case((40,), 4, 128, torch.bfloat16, seed=11)
    alone = kernels.hc_coefficients(X[7:8], fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    batch = kernels.hc_coefficients(X, fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    for a, b in zip(alone, batch, strict=True):
        assert torch.equal(a[0], b[7])


def test_hc_coefficients_keep_the_torch_form_for_gradients_and_fp64() -> None:
    """The kernels have no backward and compute in fp32: with a gradient to carry, or on an fp64 model, the op runs
    the torch form, so the result carries the gradient / stays fp64 bit for bit."""
    X, fn, scale, base = coefficients_case((2,), 4, 32, torch.float32, seed=3)
    scale.requires_grad_(True)
    _pre, post, comb = kernels.hc_coefficients(X, fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    (post.sum() + comb.sum()).backward()
    assert scale.grad is not None
    wide = [t.double() for t in coefficients_case((2,), 4, 32, torch.float32, seed=4)]
    got = kernels.hc_coefficients(*wide, 4, 20, 1e-6, 1e-6, backend="triton")
    want = mhc.hc_split_sinkhorn(mhc.hc_mixes(wide[0], wide[1], 1e-6), *wide[2:], 4, 20, 1e-6)
    for g_part, w_part in zip(got, want, strict=True):
        assert g_part.dtype == torch.float64
        assert torch.equal(g_part, w_part)


def test_hc_coefficients_name_bad_shapes() -> None:
    X, fn, scale, base = coefficients_case((2,), 4, 32, torch.float32, seed=5)
    with pytest.raises(ValueError, match="fn"):
        kernels.hc_coefficients(X, fn[:, :-1], scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="X"):
        kernels.hc_coefficients(X[..., :3, :], fn, scale, base, 4, 20, 1e-6, 1e-6, backend="triton")
    odd = coefficients_case((2,), 3, 32, torch.float32, seed=6)
    with pytest.raises(ValueError, match="power of two"):
        kernels.hc_coefficients(*odd, 3, 20, 1e-6, 1e-6, backend="triton")


def rope_case(shape: tuple[int, ...], pos_dims: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = generator(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    positions = torch.randint(0, 1_048_576, shape[:pos_dims], generator=g)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    return x, positions, inv_freq


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(
    ("shape", "pos_dims", "dtype"),
    [((7, 32), 1, torch.float32), ((2, 3, 4, 96), 2, torch.float32), ((2, 5, 64), 2, torch.bfloat16),
     ((1, 1, 8, 160), 2, torch.bfloat16), ((0, 32), 1, torch.float32)],
)  # fmt: skip
def test_rope_rotate_matches_the_torch_form(shape: tuple[int, ...], pos_dims: int, dtype: torch.dtype, inverse: bool):
    """Positions up to 2^20 (fp64 angles), a heads axis broadcast, a non-rotary prefix left as it is."""
    x, positions, inv_freq = rope_case(shape, pos_dims, dtype, seed=len(shape) + pos_dims)
    want = kernels.rope_rotate(x, positions, inv_freq, inverse, backend="torch")
    got = kernels.rope_rotate(x, positions, inv_freq, inverse, backend="triton")
    assert got.dtype == dtype
    assert torch.equal(got[..., :-32], x[..., :-32])
    # fp32: the kernel may fuse a product into an FMA (one rounding fewer); bf16: that can flip the last bit
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tolerance)


def test_rope_rotate_keeps_the_torch_form_for_gradients_and_fp64_and_names_bad_shapes() -> None:
    x, positions, inv_freq = rope_case((3, 32), 1, torch.float32, seed=9)
    x.requires_grad_(True)
    kernels.rope_rotate(x, positions, inv_freq, False, backend="triton").sum().backward()
    assert x.grad is not None
    wide = x.detach().double()
    want = kernels.rope_rotate(wide, positions, inv_freq, False, backend="torch")
    assert torch.equal(kernels.rope_rotate(wide, positions, inv_freq, False, backend="triton"), want)
    with pytest.raises(ValueError, match="rotary dims"):
        kernels.rope_rotate(torch.zeros(3, 16), positions, inv_freq, False, backend="triton")
    with pytest.raises(ValueError, match="positions"):
        kernels.rope_rotate(torch.zeros(3, 32), torch.zeros(4, dtype=torch.long), inv_freq, False, backend="triton")
