"""The Triton indexer kernel at its default launch and at every launch knob, against the reference in Triton's
interpreter: the same index arithmetic, tile loads (TMA copies and per-thread loads), channel-block cuts and tile loops
as on the GPU, with fp32 dot operands (the interpreter's default) or fp16 ones (the pre-sm_89 GPU operand; the
interpreter dots them exactly)."""

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import assert_indexer_scores_close, generator, indexer_case

from model import kernels
from model.kernels import indexer

LAUNCHES = [
    {},  # the interpreter's defaults: 32 positions per tile, 2 tiles per program at T = 1, 1 for prefill tiles
    {"block_s": 16, "tiles_per_program": 3},  # programs whose tiles run past S (wholly past it at S = 70): masked
    {"block_s": 64, "tiles_per_program": 1},  # no loop, one tile wider than S = 33 / 45 / 50
    {"tiles_per_program": 4, "num_stages": 2},
    {"operand": indexer.FP16.value},
    {"tma": False},  # per-thread loads of the K tiles (GPUs before sm_90)
]
SHAPES = [(2, 1, 4, 64, 50), (1, 3, 32, 128, 70), (3, 5, 3, 32, 33), (2, 1, 5, 96, 45)]  # Di = 96: padded to 128


def launch_id(launch: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in launch.items()) or "default"


@pytest.mark.parametrize("launch", LAUNCHES, ids=launch_id)
@pytest.mark.parametrize(("B", "T", "H", "Di", "S"), SHAPES)
def test_matches_the_reference(launch: dict, B: int, T: int, H: int, Di: int, S: int) -> None:
    """Ragged rows (one full, one empty, the rest random n_visible), tails of S that no tile size divides."""
    case = indexer_case(generator(B * S + T), B, T, H, Di, S)
    got = indexer.indexer_scores_triton(*case, indexer.IndexerTuning(**launch))
    assert_indexer_scores_close(got, kernels.indexer_scores(*case), case)


def test_extreme_scales() -> None:
    """UE8M0 bytes from 0 (2^-127, an fp32 subnormal) to 200, on K rows of every tile position and queries large and
    small: the per-block rescale keeps what the reference's dequantised values give."""
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(5), 2, 1, 4, 128, 40)
    g = generator(6)
    k_scale = torch.randint(0, 201, k_scale.shape, generator=g, dtype=torch.uint8)
    k_scale[0, :4] = torch.tensor([0, 1, 2, 200], dtype=torch.uint8)[:, None]
    q_scale = torch.randint(100, 160, q_scale.shape, generator=g, dtype=torch.uint8)
    case = (q_data, q_scale, w, k_data, k_scale, n_visible)
    want = kernels.indexer_scores(*case)
    assert (want[torch.isfinite(want)].abs() > 2.0**60).any()  # the case reaches the large scales
    for launch in LAUNCHES:
        assert_indexer_scores_close(indexer.indexer_scores_triton(*case, indexer.IndexerTuning(**launch)), want, case)


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ({"block_s": 48}, "block_s must be a power of two ≥ 16"),
        ({"block_s": 8}, "block_s must be a power of two ≥ 16"),
        ({"tiles_per_program": 0}, "tiles_per_program must be 1 … 512 at block_s 32"),
        ({"block_s": 256, "tiles_per_program": 65}, "tiles_per_program must be 1 … 64 at block_s 256"),
        ({"operand": 3}, "operand must be FP8"),
        ({"max_registers": 8}, "max_registers must be 16 … 255"),
    ],
)
def test_bad_launch_is_named(launch: dict, message: str) -> None:
    case = indexer_case(generator(0), 1, 1, 4, 64, 8)
    with pytest.raises(ValueError, match=message):
        indexer.indexer_scores_triton(*case, indexer.IndexerTuning(**launch))


@pytest.mark.parametrize("launch", [{}, {"operand": indexer.FP16.value}], ids=launch_id)
@pytest.mark.parametrize("spread", [0, 30, 40, 120])
def test_query_block_scales_far_apart(launch: dict, spread: int) -> None:
    """A query's per-block scales normally ride in its operand, relative to its largest (exact within 2^-14 in
    FP8, 2^-36 in FP16, 2^-100 in the interpreter's FP32); wider spreads rescale each block's dot instead. Both
    give the reference's scores, also beside a block of zero codes at the quantiser's floor."""
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(spread), 2, 3, 4, 128, 40)
    q_scale = torch.full_like(q_scale, 150)
    q_scale[0, :, :, 1] = 150 - spread  # every head of batch row 0: block 1 far below the others
    q_scale[1, 0, 0, 2] = 1  # a zero block at the quantiser's floor beside scales of 2^23
    q_data[1, 0, 0, 32:48] = 0
    case = (q_data, q_scale, w, k_data, k_scale, n_visible)
    assert_indexer_scores_close(
        indexer.indexer_scores_triton(*case, indexer.IndexerTuning(**launch)), kernels.indexer_scores(*case), case
    )


def test_nan_scales_give_nan_scores() -> None:
    """UE8M0 255 is NaN: a query's NaN scale makes its visible scores NaN, a K entry's NaN scale that position's, as
    in the reference; the rest is unaffected (and the programs without a NaN K scale keep their fast decode)."""
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(9), 1, 3, 4, 128, 200)
    n_visible[:] = 200
    q_scale[0, 0, 1, 3] = 255
    k_scale[0, 7, 2] = 255
    case = (q_data, q_scale, w, k_data, k_scale, n_visible)
    want = kernels.indexer_scores(*case)
    got = indexer.indexer_scores_triton(*case)
    assert want[0, 0].isnan().all()
    assert want[0, 1:, 7].isnan().all()
    assert want[0, 1:].isnan().sum() == 2
    assert torch.equal(got.isnan(), want.isnan())
    assert_indexer_scores_close(got, want, case)


@pytest.mark.parametrize("capacity", [0, 18, 13])
def test_cache_views(capacity: int) -> None:
    """K entries read in place from buffers with room for `capacity` more per row (the cache's `[:, :n]` views):
    the same scores as from dense rows. Rows of 70 + 18 entries: bytes and scale words both by TMA; of 70 or 83: the
    scale rows off TMA's 16-byte pitch, so the scales take per-thread loads beside the TMA bytes."""
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(capacity), 3, 1, 4, 128, 70)
    B, S = k_data.shape[:2]
    room_data = torch.zeros(B, S + capacity, k_data.shape[2], dtype=torch.uint8)
    room_scale = torch.zeros(B, S + capacity, k_scale.shape[2], dtype=torch.uint8)
    room_data[:, :S], room_scale[:, :S] = k_data, k_scale
    want = kernels.indexer_scores(q_data, q_scale, w, k_data, k_scale, n_visible)
    for launch in ({}, {"block_s": 16, "tiles_per_program": 3}):
        got = indexer.indexer_scores_triton(
            q_data, q_scale, w, room_data[:, :S], room_scale[:, :S], n_visible, indexer.IndexerTuning(**launch)
        )
        assert_indexer_scores_close(got, want, (q_data, q_scale, w, k_data, k_scale, n_visible))


def test_k_scales_outside_the_plain_range() -> None:
    """K scale bytes 0 (2^-127) and 255 (NaN), which the quantiser never writes, beside queries whose scales fold:
    the programs holding them decode every K scale the general way, so a 2^-127 entry scores its tiny value and a
    NaN one NaN, as in the reference (the two-operation decode would give 0 and ±inf)."""
    q_data, q_scale, w, k_data, k_scale, n_visible = indexer_case(generator(11), 2, 1, 4, 128, 96)
    n_visible[:] = 96
    q_scale.fill_(160)  # queries of 2^33 with every block scale equal (they fold): 2^-127 · 2^33 is a normal fp32
    k_scale[0, 5] = 0
    k_scale[1, 70, 1] = 255
    case = (q_data, q_scale, w, k_data, k_scale, n_visible)
    want = kernels.indexer_scores(*case)
    assert want[0, 0, 5] != 0
    assert want[1, 0, 70].isnan()
    for launch in LAUNCHES:
        got = indexer.indexer_scores_triton(*case, indexer.IndexerTuning(**launch))
        assert torch.equal(got.isnan(), want.isnan())
        assert_indexer_scores_close(got, want, case)


@triton.jit
def _plain_scales_probe(ks_ptr, out_ptr, first, last, SCAN: tl.constexpr):
    tl.store(out_ptr, indexer._all_plain_scales(ks_ptr, 0, first, last, 128, SCAN).to(tl.int32))


@pytest.mark.parametrize(
    ("first", "last", "special", "plain"),
    [
        (16, 64, None, True),
        (80, 100, None, True),  # a program's positions past S (its scan reaches 80 + 64): unread
        (16, 64, (40, 0), False),  # 2^-127
        (16, 64, (63, 255), False),  # NaN, in the last position scanned
        (16, 64, (64, 0), True),  # just past the positions scanned
        (16, 64, (15, 255), True),  # just before them
    ],
)
def test_all_plain_scales(first: int, last: int, special: tuple[int, int] | None, plain: bool) -> None:
    """The scan that picks the two-operation scale decode: every scale byte of positions first … last − 1 in
    1 … 254, the positions past `last` left out (a false alarm costs the slow decode, which no test of the scores
    sees: before the fix, every program over the end of a row took it)."""
    scales = torch.randint(1, 255, (100, 4), generator=generator(first + last), dtype=torch.uint8)
    if special is not None:
        scales[special[0], 1] = special[1]
    out = torch.zeros(1, dtype=torch.int32)
    _plain_scales_probe[(1,)](scales, out, first, last, SCAN=64)
    assert bool(out.item()) is plain


@pytest.mark.parametrize("invariant", [False, True])
def test_indexer_under_batch_invariance_sums_heads_in_the_decode_layout(monkeypatch, invariant: bool) -> None:
    """A program's head sum runs over its [positions, queries, heads] tile, so a verify's T queries must take the
    decode step's queries per program for its scores to keep their bits: by default a wider tile (8 heads: 2 queries
    alone, 8 among 6), under batch invariance the same."""
    from model.kernels import invariance

    monkeypatch.setattr(invariance, "_invariant", invariant)
    assert (indexer.query_block(1, 8) == indexer.query_block(6, 8)) == invariant
    assert (indexer.query_block(1, 32) == indexer.query_block(6, 32)) == invariant
