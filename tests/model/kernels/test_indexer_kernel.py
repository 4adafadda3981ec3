"""The indexer kernel's alternative paths (bench/kernels.py tune-indexer times them on a GPU) against the reference,
in Triton's interpreter: the same index arithmetic, channel halves and tile loops as on the GPU, fp32 dot operands."""

import pytest
import torch
from kernel_cases import assert_indexer_scores_close, generator, indexer_case

from model import kernels, quant
from model.kernels import indexer

VARIANTS = [
    {"split": True},
    {"fold": True},
    {"tiles_per_program": 3, "block_s": 16},  # the last program's tiles run past S: masked
    {"fold": True, "tiles_per_program": 2, "num_stages": 2},
    {"split": True, "tiles_per_program": 4, "block_s": 16},
    {"whole_tile": True},
    {"whole_tile": True, "split": True, "tiles_per_program": 2},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize(("B", "T", "H", "Di", "S"), [(2, 1, 4, 64, 50), (1, 3, 32, 128, 70), (3, 5, 3, 32, 33)])
def test_variant_matches_the_reference(variant: dict, B: int, T: int, H: int, Di: int, S: int) -> None:
    case = indexer_case(generator(B * S + T), B, T, H, Di, S)
    got = indexer.indexer_scores_triton(*case, **variant)
    assert_indexer_scores_close(got, kernels.indexer_scores(*case), case)


def test_variants_at_extreme_scales() -> None:
    """UE8M0 bytes from 0 (2^-127, an fp32 subnormal) to 200: the folded operands keep every dequantised value."""
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(5), 2, 1, 4, 128, 40)
    g = generator(6)
    k_scale = torch.randint(0, 201, k_scale.shape, generator=g, dtype=torch.uint8)
    k_scale[0, :4] = torch.tensor([0, 1, 2, 200], dtype=torch.uint8)[:, None]
    q_scale = torch.randint(100, 160, q_scale.shape, generator=g, dtype=torch.uint8)
    case = (q_data, q_scale, w, k_data, k_scale, n_visible)
    want = kernels.indexer_scores(*case)
    for variant in VARIANTS:
        assert_indexer_scores_close(indexer.indexer_scores_triton(*case, **variant), want, case)


def test_folded_values_are_exact_in_bf16() -> None:
    """Why `fold` loses nothing: every E2M1 code times every UE8M0 scale, as the fp32 reference dequantises it
    (subnormals, overflow to inf and the NaN byte included), is a bf16 number."""
    even = torch.arange(0, 16, 2, dtype=torch.uint8)
    row = (even | ((even + 1) << 4)).repeat(2)  # 16 bytes: the 16 codes twice (32 channels, one scale block)
    values = quant.fp4_dequant_ue8m0(row.repeat(256, 1), torch.arange(256, dtype=torch.uint8)[:, None])
    assert values.isinf().any()  # the case reaches overflow, the NaN byte and fp32 subnormals
    assert values.isnan().any()
    assert (values[values != 0].abs() < 2.0**-126).any()
    torch.testing.assert_close(values.to(torch.bfloat16).float(), values, rtol=0, atol=0, equal_nan=True)


def test_bad_variant_is_named() -> None:
    case = indexer_case(generator(0), 1, 1, 4, 64, 8)
    with pytest.raises(ValueError, match="split needs 16-bit"):
        indexer.indexer_scores_triton(*case, split=True, operand=indexer.FP8.value)
    with pytest.raises(ValueError, match="tiles_per_program"):
        indexer.indexer_scores_triton(*case, tiles_per_program=0)
