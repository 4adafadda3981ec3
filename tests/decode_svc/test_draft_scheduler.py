"""DSpark's hardware-aware scheduler as pure logic: its decisions on given step times and confidences, the step-time
table it reads them from, and the per-sequence records that turn confidences into acceptance chances."""

from __future__ import annotations

import itertools

import pytest

from decode_svc.scheduler import (
    PROBE_MAX,
    PROBE_MIN,
    TRUST_HALF_LIFE,
    DraftScheduler,
    Plan,
    bucket,
    expected_tokens,
    widen,
)
from decode_svc.speculation import OUTCOME_HALF_LIFE, RELAX_HALF_LIFE, DraftRecord, draft_caps, outcome
from decode_svc.step_times import Forward, StepTimes

MS = 1e-3
DECAY = 0.5 ** (1 / TRUST_HALF_LIFE)


def measured(plain: dict[int, float], draft: dict[int, float], verify: dict[int, float]) -> StepTimes:
    """A table holding these seconds by token count (as if each had been measured once)."""
    times = StepTimes()
    for forward, table in ((Forward.PLAIN, plain), (Forward.DRAFT, draft), (Forward.VERIFY, verify)):
        for tokens, seconds in table.items():
            times.observe(forward, tokens, seconds)
    return times


# The demo checkpoint on this 2-core CPU (bench figures, rounded): a verify column costs most of a plain step.
CPU = measured(
    plain={1: 80 * MS, 8: 133 * MS},
    draft={1: 54 * MS, 8: 205 * MS},
    verify={2: 100 * MS, 6: 145 * MS, 16: 265 * MS, 48: 890 * MS},
)
# An accelerator: every forward of a small batch costs the same launch-bound time.
GPU = measured(plain={1: 10 * MS, 64: 10 * MS}, draft={1: 4 * MS, 64: 4 * MS}, verify={2: 11 * MS, 384: 11 * MS})


def test_tau_counts_each_row_up_to_the_width_and_its_cap() -> None:
    a = [[0.9, 0.8, 0.5], [0.6, 0.3, 0.1]]
    assert expected_tokens(a, [3, 3], 0) == 2.0
    assert expected_tokens(a, [3, 3], 2) == pytest.approx(2 + 0.9 + 0.8 + 0.6 + 0.3)
    assert expected_tokens(a, [3, 1], 3) == pytest.approx(2 + 0.9 + 0.8 + 0.5 + 0.6)  # the second row's cap


def test_widen_stops_at_the_first_column_that_does_not_raise_the_throughput() -> None:
    a = [[0.9, 0.8, 0.5, 0.2, 0.1]]
    seconds = {0: 80, 1: 100, 2: 115, 3: 130, 4: 145, 5: 160}  # ms: 12.5, 19.0, 23.5, 24.6, 23.4, … tokens/s
    assert widen(a, [5], lambda w: seconds[w] * MS, 0) == (3, pytest.approx(3.2 / 0.130))
    assert widen(a, [2], lambda w: seconds[w] * MS, 0)[0] == 2  # the cap ends it first
    # Not past a column that does not pay, even when a wider one would (the paper's early stop).
    step = {0: 80, 1: 200, 2: 200, 3: 200, 4: 200, 5: 200}
    assert widen([[0.6] * 5], [5], lambda w: step[w] * MS, 0)[0] == 0


def test_a_cpu_verifies_only_confident_drafts_a_gpu_every_draft_with_a_chance() -> None:
    cpu, gpu = DraftScheduler(CPU), DraftScheduler(GPU)
    confident, doubtful = [[0.95, 0.9, 0.85, 0.8, 0.75]], [[0.2, 0.05, 0.01, 0.003, 0.001]]
    assert cpu.width(confident, [5]) == 5
    assert cpu.width(doubtful, [5]) == 0
    assert gpu.width(doubtful, [5]) == 5
    assert gpu.width([[0.3, 0.1, 0.0, 0.0, 0.0]], [5]) == 2  # a draft with no chance is not worth even a free column
    assert gpu.width(confident, [3]) == 3  # never past the caps


def test_batch_size_moves_the_decision_on_a_cpu_not_on_a_gpu() -> None:
    """SPS(B): on the CPU a verify over 8 rows costs several plain steps of 8 rows; on the GPU nothing."""
    cpu, gpu = DraftScheduler(CPU), DraftScheduler(GPU)
    one = [[0.8, 0.6, 0.4, 0.2, 0.1]]
    assert cpu.width(one, [5]) >= 1
    assert cpu.width(one * 8, [5] * 8) == 0
    assert gpu.width(one * 8, [5] * 8) == 5


def test_a_step_drafts_when_its_forecast_pays_and_probes_after_a_run_of_plain_steps() -> None:
    cpu = DraftScheduler(CPU)
    assert cpu.plan([[1.0] * 5], [5]) is Plan.DRAFT  # a new sequence's hopeful forecast: 6 tokens for 199 ms
    stale = [[0.5, 0.3, 0.1, 0.0, 0.0]]  # at best 1.8 tokens for 165 ms, the draft's own 54 ms counted: no
    assert [cpu.plan(stale, [5]) for _ in range(PROBE_MIN)] == [Plan.PLAIN] * (PROBE_MIN - 1) + [Plan.PROBE]
    assert [cpu.plan(stale, [5]) for _ in range(2 * PROBE_MIN)] == [Plan.PLAIN] * (2 * PROBE_MIN - 1) + [Plan.PROBE]
    assert cpu.plan([[1.0] * 5], [5]) is Plan.DRAFT  # drafting on the forecast resets the wait
    assert [cpu.plan(stale, [5]) for _ in range(PROBE_MIN)][-1] is Plan.PROBE
    assert cpu.plan([[1.0] * 5], [0, 0]) is Plan.PLAIN  # no room for a draft: nothing to decide, nothing counted


def test_drafted_steps_that_lose_to_plain_steps_cost_the_forecast_its_trust() -> None:
    """A hopeful forecast (every draft accepted: 2.4× a plain step on this CPU) whose drafts the real confidences
    then never verify: each such step emits one token per row for a draft and a plain step's seconds (0.6×). After
    two of them the scheduler no longer believes the forecast; a probe that realises more than promised restores it."""
    cpu = DraftScheduler(CPU)
    hopeful = [[1.0] * 5]
    drafted = 0
    while cpu.plan(hopeful, [5]) is Plan.DRAFT:
        drafted += 1
        cpu.realised(rows=1, tokens=1, width=0)
    assert drafted == 2
    assert cpu.trust(1) == pytest.approx((0.597 * (1 + DECAY) + 1) / (2.41 * (1 + DECAY) + 1), rel=0.01)
    plans = [cpu.plan(hopeful, [5]) for _ in range(PROBE_MIN - 1)]
    assert plans == [Plan.PLAIN] * (PROBE_MIN - 2) + [Plan.PROBE]  # the step that stopped drafting counted
    cpu.realised(rows=1, tokens=6, width=5)  # every draft accepted: 6 tokens for 199 ms, the promise kept
    cpu.realised(rows=1, tokens=6, width=5)
    assert cpu.plan(hopeful, [5]) is Plan.DRAFT


def test_each_batch_bucket_keeps_a_trust_of_its_own() -> None:
    """Drafted steps of 24 rows that lose to plain steps cost the 17–32 bucket its trust, not a lone row's: a row
    alone afterwards drafts on its forecast at once."""
    gpu = DraftScheduler(GPU)
    hopeful, wide = [[1.0] * 5], [[1.0] * 5] * 24
    while gpu.plan(wide, [5] * 24) is Plan.DRAFT:
        gpu.realised(rows=24, tokens=24, width=0)
    assert gpu.trust(24) == gpu.trust(17) < 0.5
    assert gpu.trust(1) == gpu.trust(16) == 1.0
    assert gpu.plan(hopeful, [5]) is Plan.DRAFT
    assert [bucket(n) for n in (1, 2, 3, 16, 17, 256)] == [1, 2, 4, 16, 32, 256]


def test_sampled_batches_keep_a_trust_apart_from_greedy_ones() -> None:
    """Drafted steps with a sampled row that lose to plain steps cost the sampled trust of their bucket, not the greedy
    one: an all-greedy batch of that size afterwards drafts on its forecast at once."""
    gpu = DraftScheduler(GPU)
    hopeful = [[1.0] * 5]
    while gpu.plan(hopeful, [5], greedy=False) is Plan.DRAFT:
        gpu.realised(rows=1, tokens=1, width=0)
    sampled = gpu.trust(1, greedy=False)
    assert sampled < 0.5
    assert gpu.trust(1, greedy=True) == 1.0
    assert gpu.plan(hopeful, [5], greedy=True) is Plan.DRAFT
    gpu.realised(rows=1, tokens=4, width=5)  # 4 of the 6 tokens promised: the greedy trust alone answers for it
    assert gpu.trust(1, greedy=True) == pytest.approx((4 / 15 * 10 + 1) / (6 / 15 * 10 + 1))
    assert gpu.trust(1, greedy=False) == sampled


def test_probes_back_off_to_the_longest_wait() -> None:
    gpu = DraftScheduler(GPU)
    never = [[0.0] * 5]
    probes = [i for i in range(4 * PROBE_MAX) if gpu.plan(never, [5]) is Plan.PROBE]
    gaps = [b - a for a, b in itertools.pairwise([-1, *probes])]
    assert gaps[:6] == [PROBE_MIN, 2 * PROBE_MIN, 4 * PROBE_MIN, 8 * PROBE_MIN, 16 * PROBE_MIN, 32 * PROBE_MIN]
    assert set(gaps[6:]) == {PROBE_MAX}


def test_full_policy_and_unmeasured_forwards_verify_every_draft_the_caps_allow() -> None:
    full = DraftScheduler(CPU, full=True)
    assert full.plan([[0.0] * 5], [5]) is Plan.DRAFT
    assert full.width([[0.0] * 5, [0.0] * 5], [5, 2]) == 5
    fresh = DraftScheduler(StepTimes())  # nothing measured yet: measure it
    assert fresh.plan([[0.0] * 5], [4]) is Plan.DRAFT
    assert fresh.width([[0.0] * 5], [4]) == 4


def test_the_verify_goes_ahead_of_the_draft_only_where_its_width_costs_nothing() -> None:
    """Launched before the confidences are read, a verify runs at the widest width: only where that is as cheap as
    one column (a launch-bound GPU), where every draft is verified anyway, or while a forward is still unmeasured."""
    assert DraftScheduler(GPU).ahead(1, 5)
    assert DraftScheduler(GPU).ahead(64, 5)
    assert not DraftScheduler(CPU).ahead(1, 5)
    assert DraftScheduler(CPU, full=True).ahead(1, 5)
    assert DraftScheduler(StepTimes()).ahead(1, 5)
    times = measured(plain={1: 10 * MS}, draft={1: 4 * MS}, verify={2: 10 * MS, 6: 10.4 * MS, 24: 12 * MS})
    assert DraftScheduler(times).ahead(1, 5)  # 6 tokens against 2: 4 % dearer, free of its width
    assert not DraftScheduler(times).ahead(4, 5)  # 24 tokens against 8: 12 against 10.58 ms, 13 % dearer


def test_a_step_whose_verify_goes_ahead_is_planned_at_the_widest_width() -> None:
    """A GPU's table where the narrow verifies were measured slow (launched after the host chose their width, the
    full forward timed) and the widest fast (queued behind the draft, the remainder timed): drafting pays at the
    widest width, where a chained batch's verify goes, though no narrow width pays. An unchained batch (the verify
    waits for the host's choice) is planned on the widths it could choose."""
    times = measured(plain={1: 1.5 * MS}, draft={1: 1.2 * MS}, verify={2: 2.4 * MS, 3: 2.6 * MS, 5: 1.3 * MS})
    forecast = [[0.6, 0.05, 0.05, 0.05]]  # (1 + 0.75) / 2.5 ms against 1 / 1.5 ms: 1.05x at the widest
    assert DraftScheduler(times).ahead(1, 4)
    assert DraftScheduler(times).plan(forecast, [4], chained=True) is Plan.DRAFT
    assert DraftScheduler(times).plan(forecast, [4], chained=False) is Plan.PLAIN  # best: 1 draft, 0.67x


def test_step_times_are_medians_read_between_and_beyond_the_sizes_measured() -> None:
    times = StepTimes(window=5)
    assert not times.measured(Forward.PLAIN)
    with pytest.raises(ValueError, match="no plain forward has been measured"):
        times.seconds(Forward.PLAIN, 1)
    for seconds in (0.010, 0.011, 0.500, 0.009):  # one step slowed by something else
        times.observe(Forward.PLAIN, 1, seconds)
    assert times.seconds(Forward.PLAIN, 1) == pytest.approx(0.0105)
    assert times.seconds(Forward.PLAIN, 7) == pytest.approx(0.0105)  # one size known: the same for every size
    times.observe(Forward.PLAIN, 5, 0.030)
    assert times.seconds(Forward.PLAIN, 3) == pytest.approx(0.0105 + 2 * (0.030 - 0.0105) / 4)  # between
    assert times.seconds(Forward.PLAIN, 9) == pytest.approx(0.030 + 4 * (0.030 - 0.0105) / 4)  # past: the slope
    times.observe(Forward.VERIFY, 4, 0.020)
    times.observe(Forward.VERIFY, 8, 0.010)  # noise: a larger forward measured faster
    assert times.seconds(Forward.VERIFY, 16) == 0.010  # past the sizes: never cheaper for more tokens
    assert times.seconds(Forward.VERIFY, 2) == 0.020  # below: as the smallest, never towards 0
    assert times.measured(Forward.PLAIN, Forward.VERIFY)
    assert not times.measured(*Forward)
    for _ in range(3):  # the machine got slower: the window follows it
        times.observe(Forward.PLAIN, 1, 0.020)
    assert times.seconds(Forward.PLAIN, 1) == 0.020
    assert times.known(Forward.PLAIN) == {1: 0.020, 5: 0.030}


def test_a_record_calibrates_its_drafts_on_what_was_accepted() -> None:
    record = DraftRecord(prior=0.8)
    a = record.drafted([0.9, 0.5, 0.5])
    assert a == pytest.approx([0.8 * 0.9, 0.8 * 0.45, 0.8 * 0.225])
    promised, seen = record.record(proposed=2, accepted=2)
    assert promised == pytest.approx(0.9 + 0.45)
    assert seen == [1.0, 1.0]  # drafts 1 and 2 accepted; of the third, not shown, nothing is known
    assert record.calibration == pytest.approx((2 + 0.8) / (1.35 + 1))
    assert record.drafted([0.9, 0.5]) == pytest.approx([min(1.0, record.calibration * 0.9), record.calibration * 0.45])
    assert (record.proposed, record.accepted) == (2, 2)
    assert DraftRecord(prior=3.0).drafted([0.9, 0.9]) == [1.0, 1.0]  # a chance, at most 1


def test_a_verify_tells_of_the_positions_it_verified_and_of_all_after_a_rejection() -> None:
    assert outcome(4, proposed=3, accepted=1) == [1.0, 0.0, 0.0, 0.0]  # nothing after a rejected draft is accepted
    assert outcome(4, proposed=2, accepted=2) == [1.0, 1.0]  # the two not shown might have been
    assert outcome(4, proposed=0, accepted=0) == []


def test_a_forecast_follows_the_rows_outcomes_and_relaxes_to_the_replicas_while_it_waits() -> None:
    record = DraftRecord()
    assert record.forecast(3, None) == [1.0, 1.0, 1.0]  # a replica that never verified: hopeful
    assert record.forecast(3, [0.6, 0.2]) == [0.6, 0.2, 0.2]  # before its own first verify: the replica's
    record.drafted([0.5] * 4)
    record.record(proposed=4, accepted=4)
    record.drafted([0.5] * 4)
    record.record(proposed=3, accepted=1)
    d = 0.5 ** (1 / OUTCOME_HALF_LIFE)
    mine = [1.0, d, d, d]  # all four accepted, then the first alone
    assert record.forecast(4, [0.6, 0.2]) == pytest.approx(mine)
    for _ in range(int(RELAX_HALF_LIFE)):
        record.waited()
    halfway = [(m + t) / 2 for m, t in zip(mine, [0.6, 0.2, 0.2, 0.2], strict=True)]
    assert record.forecast(4, [0.6, 0.2]) == pytest.approx(halfway)
    record.drafted([0.5] * 4)
    record.record(proposed=2, accepted=2)  # a verify renews the forecast: back to the row's own
    assert record.forecast(4, [0.6, 0.2]) == pytest.approx([1.0, d * d + (1 - d), d, d])


def test_caps_end_at_the_budget_and_after_the_first_stop_token_draft() -> None:
    tokens = [[5, 6, 7, 8, 9]] * 3
    assert draft_caps(tokens, [5, 5, 2], [frozenset()] * 3) == [5, 5, 2]
    assert draft_caps(tokens, [5, 5, 5], [frozenset({7}), frozenset({5, 9}), frozenset({42})]) == [3, 1, 5]
