"""DSpark in the engine: verification is lossless with drafts really accepted (several tokens per step), commits
exactly what the stream sent (budget and stop tokens cap the drafts), and sampled speculation keeps the target's
distribution."""

from __future__ import annotations

import asyncio
import copy
import itertools
import math
import threading
from collections.abc import Callable

import pytest
import torch
from service_mesh import Mesh, metric_value, token_ids, wait_until

from decode_svc.sampler import StepSampling
from decode_svc.sequence import Outbox, Params, Sampling, Sequence
from decode_svc.speculation import Calibration, DraftRecord, outcome
from decode_svc.step_times import Forward, StepTimes
from mesh.block_keys import sequence_key
from model import Transformer
from proto.decode.v1 import decode_pb2

# A Markov-head logit bias that makes the forced token the draft's arg-max whatever the DSpark blocks say.
FORCE = 1000.0


def oracle_drafter(full: Transformer, continuation: list[int]) -> Transformer:
    """A copy of the model whose DSpark proposes, after each token of `continuation`, the token that follows it there.

    The Markov head is a rank-r bigram table W1[prev] W2ᵀ: token i of the table gets the one-hot W1 row e_i and the
    column of its successor in W2; the confidence head reads the same one-hot, so known bigrams get confidence ≈ 1.
    Everything else (the target model, its weights and fingerprint) is unchanged."""
    model = copy.deepcopy(full)
    last = model.mtp[-1]
    rank, C = last.markov_head.embed.weight.shape[1], model.args.hidden_size
    successors: dict[int, int] = {}
    for prev, nxt in itertools.pairwise(continuation):
        successors.setdefault(prev, nxt)
    with torch.no_grad():
        last.markov_head.embed.weight.zero_()
        last.markov_head.head.weight.zero_()
        last.confidence_head.proj.weight.zero_()
        last.confidence_head.proj.weight[0, C:] = 20.0
        for i, (prev, nxt) in enumerate(list(successors.items())[:rank]):
            last.markov_head.embed.weight[prev, i] = 1.0
            last.markov_head.head.weight[nxt, i] = FORCE
    return model


def test_accepted_drafts_emit_plain_greedy_and_commit_what_was_sent(
    mesh: Mesh, start_mesh: Callable[..., Mesh], models: tuple[Transformer, Transformer], salt: bytes, prompt: Callable
) -> None:
    ids, n = prompt(19), 10
    plain, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=n, disable_speculation=True, cache_salt=salt)
    # every step drafts: what is checked is what verification emits and commits, not whether the measured
    # scheduler judges drafting worth it on this machine's step times
    oracle = start_mesh(models=(models[0], oracle_drafter(models[1], plain)), decode={"draft_policy": "full"})

    spec, messages = oracle.generate(token_ids=token_ids(ids), max_tokens=n, cache_salt=salt)
    assert spec == plain
    usage = messages[-1].usage
    assert usage.draft_tokens_accepted >= n // 2  # drafts really were accepted …
    assert max(len(m.token_ids) for m in messages) > 1  # … several tokens per step
    assert usage.draft_tokens_proposed >= usage.draft_tokens_accepted
    # The output budget capped the drafts: the cache holds the prompt and every token sent but the last.
    Bt, fp = oracle.block_tokens, oracle.fingerprint
    with oracle.cache_client() as cache:
        wait_until(
            lambda: cache.has_record(sequence_key(ids + plain[:-1], block_tokens=Bt, fingerprint=fp, salt=salt)),
            "the SWA record at the last committed token",
        )

    # A stop token among the drafts: nothing after it is emitted or committed.
    stop = plain[6]
    stopped, messages = oracle.generate(
        token_ids=token_ids(ids), max_tokens=n, stop_token_ids=[stop], cache_salt=salt + b"/stop"
    )
    assert stopped == plain[: plain.index(stop) + 1]
    assert messages[-1].finish_reason == decode_pb2.FINISH_REASON_STOP
    ends = [ids + stopped, ids + stopped[:-1]]  # the stop token was a verified draft, or the token after them
    keys = [sequence_key(end, block_tokens=Bt, fingerprint=fp, salt=salt + b"/stop") for end in ends]
    with oracle.cache_client() as cache:
        wait_until(lambda: any(cache.has_record(k) for k in keys), "the SWA record at the stop token")


def test_sampled_speculation_keeps_the_target_distribution(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    """A sampled row (top-2 at temperature 1) and a greedy row share speculative steps (threshold 0: every step drafts
    and verifies): the greedy row still emits plain greedy tokens, and the sampled row picks its top-1 token as often
    as the target's probabilities say (a z-test over the logprobs the stream reports: a greedy, or mis-parameterised,
    sampler fails it)."""
    mesh = start_mesh(decode={"draft_policy": "full"})
    ids = prompt(15)
    reference, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=6, disable_speculation=True, cache_salt=salt)
    results: dict[str, list[decode_pb2.GenerateResponse]] = {}

    def run(name: str, **fields: object) -> None:
        results[name] = mesh.generate(token_ids=token_ids(ids), cache_salt=salt + name.encode(), **fields)[1]

    sampled = threading.Thread(
        target=run,
        args=("sampled",),
        kwargs={
            "max_tokens": 24,
            "sampling": decode_pb2.SamplingParams(temperature=1.0, top_k=2),
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    sampled.start()
    run("greedy", max_tokens=6)
    sampled.join()
    assert [t for m in results["greedy"] for t in m.token_ids] == reference
    tokens = [t for m in results["sampled"] for t in m.token_ids]
    logprobs = [lp for m in results["sampled"] for lp in m.logprobs]
    usage = results["sampled"][-1].usage
    assert usage.draft_tokens_proposed >= 5 * (usage.completion_tokens - 6)  # every step drafted (budget caps the end)
    top1 = 0
    expected = variance = 0.0
    for token, lp in zip(tokens, logprobs, strict=True):
        (a, la), (b, lb) = ((t.token_id, t.logprob) for t in lp.top)
        assert token in (a, b)  # top_k = 2
        p1 = 1 / (1 + math.exp(lb - la))  # the target's probability of its top-1 at temperature 1
        top1 += token == a
        expected += p1
        variance += p1 * (1 - p1)
    z = (top1 - expected) / math.sqrt(variance)
    print(f"top-1 picked {top1} times of {len(tokens)}, expected {expected:.1f}; z = {z:.2f}")
    assert abs(z) < 4.5


def test_the_replica_calibration_is_the_prior_and_forgets() -> None:
    calibration = Calibration(half_life_steps=2)
    assert calibration.ratio == 1.0  # no evidence: trust the head
    calibration.add(accepted=0, promised=4, seen=outcome(4, proposed=4, accepted=0))
    assert calibration.ratio == pytest.approx(1 / 5)
    for _ in range(2):
        calibration.tick()
    assert calibration.ratio == pytest.approx(1 / 3)  # half the evidence is forgotten after a half-life


def test_the_replicas_typical_outcome_is_its_recent_verifies_share_by_position() -> None:
    calibration = Calibration(half_life_steps=2)
    assert calibration.typical is None  # a replica that never verified: a new sequence's forecast is hopeful
    calibration.add(1, 1.5, outcome(3, proposed=2, accepted=1))
    calibration.add(2, 1.0, outcome(3, proposed=2, accepted=2))
    assert calibration.typical == pytest.approx([1.0, 0.5, 0.0])  # position 3: only the first told of it
    for _ in range(2):
        calibration.tick()
    calibration.add(0, 0.9, outcome(3, proposed=3, accepted=0))  # weighs twice the older two after a half-life
    assert calibration.typical == pytest.approx([0.5, 0.25, 0.0])
    assert DraftRecord().forecast(4, calibration.typical) == pytest.approx([0.5, 0.25, 0.0, 0.0])


class Machine(StepTimes):
    """The step times of a machine where a forward over n tokens costs cost(forward, n) (linear in n or flat): as if
    long measured there. The test's own steps, on this CPU, are not that machine's and are not counted."""

    def __init__(self, cost: Callable[[Forward, int], float]) -> None:
        super().__init__()
        for forward, n in itertools.product(Forward, (1, 64)):
            super().observe(forward, n, cost(forward, n))

    def observe(self, forward: Forward, tokens: int, seconds: float) -> None:
        """Another machine's step: not counted."""


def plans(metrics: str) -> dict[str, float]:
    """The speculative lane's steps by the scheduler's plan, from decode's metrics."""
    return {
        p: metric_value(metrics, "v41mesh_decode_draft_steps_total", f'plan="{p}"') for p in ("plain", "draft", "probe")
    }


def free_verification() -> Machine:
    """A forward costs the same whatever its width: verification is free."""
    return Machine(lambda forward, n: 0.01)


def verification_by_the_token() -> Machine:
    """Every token costs as much as a plain step: a draft never pays."""
    return Machine(lambda forward, n: 0.01 * n)


def test_the_scheduler_drafts_fully_where_verifying_is_free_and_never_where_it_costs_a_step_per_token(
    mesh: Mesh, start_mesh: Callable[..., Mesh], models: tuple[Transformer, Transformer], salt: bytes, prompt: Callable
) -> None:
    ids, n = prompt(17), 12
    plain, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=n, disable_speculation=True, cache_salt=salt)
    drafter = oracle_drafter(models[1], plain)  # right, and sure of it

    gpu = start_mesh(models=(models[0], drafter), times=free_verification())
    spec, messages = gpu.generate(token_ids=token_ids(ids), max_tokens=n, cache_salt=salt + b"/gpu")
    assert spec == plain
    # 1 token at join, then 5 drafts + 1 and (the budget's cap) 4 drafts + 1: every draft verified, and accepted.
    assert [len(m.token_ids) for m in messages if m.token_ids] == [1, 6, 5]
    assert (messages[-1].usage.draft_tokens_proposed, messages[-1].usage.draft_tokens_accepted) == (9, 9)

    cpu = start_mesh(models=(models[0], drafter), times=verification_by_the_token())
    spec, messages = cpu.generate(token_ids=token_ids(ids), max_tokens=n, cache_salt=salt + b"/cpu")
    assert spec == plain
    assert messages[-1].usage.draft_tokens_proposed == 0
    text = cpu.metrics(cpu.decode)
    plans = {
        p: metric_value(text, "v41mesh_decode_draft_steps_total", f'plan="{p}"') for p in ("plain", "draft", "probe")
    }
    # The forecast never pays; after 8 plain steps the lane drafts once anyway (a probe), which verifies nothing.
    assert plans == {"plain": n - 2, "draft": 0, "probe": 1}
    assert metric_value(text, "v41mesh_decode_verify_width_count") == 1
    assert metric_value(text, "v41mesh_decode_verify_width_bucket", 'le="0.0"') == 1


def test_a_drafter_that_is_always_wrong_stops_drafting_even_where_verifying_is_free(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    """The random DSpark's drafts are confidently wrong: after one verify, the online calibration makes them worth
    less than the draft forward costs even on a machine where verifying is free; only probes draft again (at
    doubling intervals), and the tokens are still plain greedy."""
    mesh = start_mesh(times=free_verification())
    ids, n = prompt(13), 40
    plain, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=n, disable_speculation=True, cache_salt=salt)
    spec, messages = mesh.generate(token_ids=token_ids(ids), max_tokens=n, cache_salt=salt + b"/spec")
    assert spec == plain
    usage = messages[-1].usage
    text = mesh.metrics(mesh.decode)
    drafted, probes = (
        metric_value(text, "v41mesh_decode_draft_steps_total", f'plan="{p}"') for p in ("draft", "probe")
    )
    assert usage.draft_tokens_accepted == 0
    assert drafted == 1  # the first step, on a new sequence's hopeful forecast
    assert probes == 2  # after 8, then 16 plain steps
    assert usage.draft_tokens_proposed == 5 * (drafted + probes)  # free verification: each drafted step verified all


def test_sampled_rows_that_lose_their_drafts_leave_a_greedy_rows_forecast_hopeful(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    """Greedy and sampled rows' drafts are accepted at different rates, so the replica keeps their calibrations, and
    the scheduler its trusts, apart: after sampled requests whose drafts the random DSpark got wrong, a greedy
    request still starts from a hopeful forecast and drafts on it (a shared calibration would forecast nothing)."""
    mesh = start_mesh(times=free_verification())
    sampled = decode_pb2.SamplingParams(temperature=1.0, seed=3)
    for n in (13, 17):
        mesh.generate(token_ids=token_ids(prompt(n)), max_tokens=24, sampling=sampled, cache_salt=salt)
    text = mesh.metrics(mesh.decode)
    drafted = metric_value(text, "v41mesh_decode_draft_steps_total", 'plan="draft"')
    assert metric_value(text, "v41mesh_decode_draft_trust", 'draws="sampled",rows="1"') < 1.0
    assert metric_value(text, "v41mesh_decode_draft_trust", 'draws="greedy",rows="1"') == 0  # no greedy step yet

    mesh.generate(token_ids=token_ids(prompt(19)), max_tokens=8, cache_salt=salt)
    text = mesh.metrics(mesh.decode)
    assert metric_value(text, "v41mesh_decode_draft_steps_total", 'plan="draft"') == drafted + 1  # its first step


def test_the_engine_measures_every_forward_at_start(mesh: Mesh) -> None:
    """The step times the scheduler starts from: plain, draft, and the narrowest and widest verify, at 1 and 2 rows."""
    engine = mesh.decode.engine
    assert engine is not None
    expected = ((Forward.PLAIN, {1, 2}), (Forward.DRAFT, {1, 2}), (Forward.VERIFY, {2, 6, 4, 12}))
    # The profile measures one row, then two: wait for the whole of it, not for its first sizes.
    wait_until(lambda: all(sizes <= set(engine.times.known(f)) for f, sizes in expected), "the start-up profile")
    for forward, _ in expected:
        assert all(seconds > 0 for seconds in engine.times.known(forward).values())


def test_a_seeded_sampled_request_emits_the_same_tokens_alone_batched_and_without_speculation(
    mesh: Mesh, start_mesh: Callable[..., Mesh], models: tuple[Transformer, Transformer], salt: bytes, prompt: Callable
) -> None:
    """T = 1 with a seed: its tokens are fixed per output position by the seed (decode_svc.sampler), so speculation on
    — with its drafts really accepted — emits what speculation off does, alone and between neighbours (greedy, and
    sampled without a seed) that draft and verify other widths. The drafter proposes the plain run's tokens: standard
    speculative sampling from a generator would reject most of them (at T = 1 the random model's target
    is spread over the whole vocabulary) and resample others."""
    ids, n = prompt(17), 12
    seeded = decode_pb2.SamplingParams(temperature=1.0, seed=7)
    request = {"token_ids": token_ids(ids), "max_tokens": n, "sampling": seeded}
    plain, _ = mesh.generate(**request, disable_speculation=True, cache_salt=salt)
    reseeded = decode_pb2.SamplingParams(temperature=1.0, seed=8)
    assert mesh.generate(**{**request, "sampling": reseeded}, disable_speculation=True, cache_salt=salt)[0] != plain

    oracle = start_mesh(models=(models[0], oracle_drafter(models[1], plain)), times=free_verification())
    alone, messages = oracle.generate(**request, cache_salt=salt + b"/alone")
    assert alone == plain
    assert messages[-1].usage.draft_tokens_accepted >= n // 2  # speculation applied to it

    neighbours = [
        {"token_ids": token_ids(prompt(9)), "max_tokens": 3 * n},
        {"token_ids": token_ids(prompt(23)), "max_tokens": 3 * n, "sampling": decode_pb2.SamplingParams(temperature=1)},
    ]
    threads = [threading.Thread(target=oracle.generate, kwargs={**r, "cache_salt": salt}) for r in neighbours]
    for t in threads:
        t.start()
    wait_until(lambda: oracle.load().running == len(neighbours), "the neighbours decoding")
    crowd, messages = oracle.generate(**request, cache_salt=salt + b"/crowd")
    for t in threads:
        t.join()
    assert crowd == plain
    assert messages[-1].usage.draft_tokens_accepted >= 1  # it drafted there too, as the lane's scheduler chose


def test_one_verify_covers_the_positions_of_as_many_plain_steps() -> None:
    """A sampled row collapses onto the same token at each output position whether a forward covers it as one of T
    positions (a verify) or one at a time (plain steps, the draft chain); a greedy row onto its arg-max."""
    V, T = 50, 4
    logits = torch.randn(3, T, V, generator=torch.Generator().manual_seed(0))

    def step(cursor: list[int]) -> StepSampling:
        return StepSampling(
            torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3), torch.ones(3), seeds=torch.tensor([11, 5, 12]),
            cursor=torch.tensor(cursor),
        )  # fmt: skip

    together = step([5, 0, 0]).probs(logits)
    one_at_a_time = step([5, 0, 0])
    apart = torch.stack([one_at_a_time.probs(logits[:, t]) for t in range(T)], 1)
    assert torch.equal(together, apart)
    assert step([0, 0, 0]).one_hot()
    assert together.eq(1).sum(-1).eq(1).all()  # every row one-hot, as promised
    assert torch.equal(together[1].argmax(-1), logits[1].argmax(-1))  # the greedy row: its arg-maxes
    shifted = step([6, 0, 0]).probs(logits[:, 1:])  # the same positions, covered from index 6: the same tokens
    assert torch.equal(shifted[0].argmax(-1), together[0, 1:].argmax(-1))
    assert not torch.equal(shifted[2].argmax(-1), together[2, 1:].argmax(-1))  # row 2 started at 0: other noise


def test_every_sampled_request_has_noise_of_its_own() -> None:
    """A request's seed keys its noise; a request without one gets a random seed, so two unseeded requests with the
    same prompt sample different tokens (sampler.py)."""

    loop = asyncio.new_event_loop()

    def sequence(seed: int | None) -> Sequence:
        sampling = Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=seed)
        return Sequence(Params("r", sampling, frozenset(), 8, False, 0, True, b""), Outbox(loop))

    try:
        assert sequence(7).noise_seed == 7
        assert len({sequence(None).noise_seed for _ in range(8)}) == 8
    finally:
        loop.close()


def test_a_verify_launched_ahead_accepts_every_draft_the_caps_allow(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    """Where a verify's width costs nothing, every drafted step launches the widest verify right behind its draft
    (`DraftScheduler.ahead`), before the confidences are read. Here a verify costs 2.5 plain steps whatever its width,
    so no confidence would pay for a column on its own (a column adds at most one token: 2 tokens in 2.5 steps'
    time) — the hopeful first forecast still drafts —, yet the verify already under way judges every draft: none is
    cut to a width of 0. The tokens are plain greedy, and every drafted step was verified (none fell back to a plain
    forward)."""
    mesh = start_mesh(times=Machine(lambda forward, n: 0.025 if forward is Forward.VERIFY else 0.01))
    ids, n = prompt(13), 40
    plain, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=n, disable_speculation=True, cache_salt=salt)
    spec, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=n, cache_salt=salt + b"/spec")
    assert spec == plain
    text = mesh.metrics(mesh.decode)
    drafted = plans(text)["draft"] + plans(text)["probe"]
    assert drafted >= 1
    assert metric_value(text, "v41mesh_decode_verify_width_bucket", 'le="0.0"') == 0  # no draft cut away
    assert metric_value(text, "v41mesh_decode_verify_width_count") == drafted
    assert metric_value(text, "v41mesh_decode_speculative_row_steps_total") == drafted
