"""A decode rank group of two (this process as rank 0, one spawned follower, gloo on loopback): what a follower's part
of a spread call raised comes back to rank 0 naming the rank; a join that one rank cannot take leaves nothing joined
on the other; a follower failing a replicated call that rank 0 completed fails the group; a follower hung in a plan
while its process lives fails the group once the plan stalls; a local prefill runs on the rank its sequence joins
only; a verify gathers the logits of the rows that report logprobs only; a row banning tokens is masked on the rank
holding it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import structlog
import torch
import torch.distributed as dist
from driven import driven_engine
from prometheus_client import CollectorRegistry, Gauge
from service_mesh import free_port

from decode_svc.config import DecodeConfig
from decode_svc.grammar import Grammars, default_tokenizer, vocabulary
from decode_svc.guide import Guide
from decode_svc.masking import Masks, admitted
from decode_svc.sampler import StepSampling
from decode_svc.sequence import Lane, State
from decode_svc.spread import SpreadBatch
from model import SamplingParams, Transformer, encode_prefill
from model_service.kvstore import encode_with_past
from model_service.ranks import GroupCalls, Outcome, RankGroup, RankGroupError, start_group
from proto.decode.v1 import decode_pb2
from tests.decode_svc.stall import hang_on_followers


@contextmanager
def group_of_two(**settings: float) -> Iterator[tuple[RankGroup, Transformer]]:
    """A fresh group of two on `tiny` and rank 0's model, torn down after the test (a test may fail the group)."""
    cfg = DecodeConfig(model="tiny", dtype="float64", threads=1, ranks=2, master_port=free_port(), **settings)
    group, model = start_group(cfg, "full", structlog.get_logger("test_spread"))
    try:
        yield group, model
    finally:
        group.close()
        dist.destroy_process_group()


@pytest.fixture
def started() -> Iterator[tuple[RankGroup, Transformer]]:
    with group_of_two() as started:
        yield started


@pytest.fixture
def calls(started: tuple[RankGroup, Transformer]) -> GroupCalls:
    return started[0].calls(started[1])


def spread_batch(calls: GroupCalls) -> SpreadBatch:
    gauge = Gauge("rows", "rows by rank", ("rank",), registry=CollectorRegistry())
    batch = SpreadBatch(calls, 2, lambda: [batch], list, gauge)
    return batch


def test_a_followers_failure_comes_back_to_rank_0(calls: GroupCalls) -> None:
    batch = spread_batch(calls)
    fine, failed = calls.spread(batch.ranks, "leave", [([],), ([7],)])  # rank 1 holds no sequence 7
    assert fine == Outcome(([], None, []))
    assert isinstance(failed.error, RuntimeError)
    assert str(failed.error) == "rank 1: KeyError: 'sequence 7 is not in this batch'"


def test_a_join_one_rank_cannot_take_leaves_nothing_joined(calls: GroupCalls) -> None:
    batch = spread_batch(calls)
    prompt = calls.run(encode_prefill, list(range(2, 30)))
    good = (prompt.blocks, prompt.encoder_state)
    empty = (prompt.blocks, dataclasses.replace(prompt.encoder_state, position=0))
    with pytest.raises(RuntimeError, match="rank 1: ValueError: cannot decode after an empty prompt"):
        batch.join_many([good, empty])  # the first to rank 0, the second to rank 1
    assert (len(batch), batch.rows_by_rank, len(batch.ranks._local.batch)) == (0, [0, 0], 0)
    (seq_id, logits), (other, _) = batch.join_many([good, good])
    assert batch.rows_by_rank == [1, 1]
    assert batch.decode_step([int(logits.argmax())] * 2).shape == (2, logits.shape[0])
    batch.leave(seq_id)
    assert (batch.seq_ids, batch.rows_by_rank) == ([other], [0, 1])


def test_a_follower_failing_a_call_rank_0_completed_fails_the_group(
    started: tuple[RankGroup, Transformer], calls: GroupCalls
) -> None:
    group, model = started
    model.probe = torch.nn.Identity()  # rank 0's model now holds what rank 1's does not
    with pytest.raises(RankGroupError, match=r"rank 1: AttributeError: .*probe") as error:
        calls.run(torch.nn.Module.get_submodule, "probe")
    assert error.value.code.name == "UNAVAILABLE"
    assert all(child.poll() is not None for child in group.children)  # no rank left running
    with pytest.raises(RankGroupError):
        calls.run(torch.nn.Module.get_submodule, "embed")


def test_a_follower_hung_in_a_plan_fails_the_group_when_the_plan_stalls(prompt: Callable[[int], list[int]]) -> None:
    """The follower's heartbeat beats on while its main thread hangs in a plan: rank 0, waiting for its report, fails
    the group once the plan has stood still for stall_timeout_s, naming the rank; a long plan that keeps passing MoE
    rounds runs on."""
    with group_of_two(stall_timeout_s=1.0, rank_timeout_s=0.5) as (group, model):
        calls = group.calls(model)
        started = time.monotonic()
        calls.run(encode_prefill, list(range(2, 2 + 400)), chunk_tokens=8)  # 50 chunks, 5 MoE rounds each
        assert time.monotonic() - started > 1.0, "the long plan must outlast the stall timeout"
        started = time.monotonic()
        with pytest.raises(RankGroupError) as error:
            calls.run(hang_on_followers, 60.0)
        assert time.monotonic() - started < 1.0 + 2.0  # the timeout, the watcher's poll, the kill
        assert error.value.message.endswith("in a plan for 1 s; behind the others: rank 1")
        assert all(child.poll() is not None for child in group.children)


def test_a_local_prefill_runs_on_the_rank_its_sequence_joins_only(
    started: tuple[RankGroup, Transformer], calls: GroupCalls, prompt: Callable[[int], list[int]]
) -> None:
    """Beside a sequence decoding on rank 0, a token-ids prompt is prefilled by rank 1 alone, in chunks, and joins it:
    rank 0 embeds no token of the prompt (only its own row's, one a step) and writes back the blocks one encoder pass
    over the whole prompt gives."""
    model = started[1]
    with driven_engine(model, calls) as d:
        running = d.submit(prompt(20), 64, handoff=calls.run(encode_prefill, prompt(20)), speculate=False)
        d.engine.iterate()  # the handoff joins rank 0, the first of two empty ranks
        assert running.state is State.RUNNING
        embedded: list[int] = []
        hook = model.embed.register_forward_hook(lambda _, args, __: embedded.append(args[0].numel()))
        ids = prompt(40)
        joining = d.submit(ids, 4, speculate=False)
        while joining.state is not State.RUNNING:
            d.engine.iterate()
        hook.remove()
        assert d.engine.batches[Lane.PLAIN].rows_by_rank == [1, 1]
        assert d.metric("local_prefill_chunks_total") == 3  # ⌈40 / 16⌉, every one on rank 1
        assert set(embedded) == {1}  # rank 0 ran its own row's steps, no chunk of the prompt
        ((_, written_ids, blocks, _),) = d.written
        whole = calls.run(encode_with_past, ids, None, 16)
        assert written_ids == ids
        assert [b.to_bytes() for b in blocks] == [b.to_bytes() for b in whole.blocks]


def test_a_verify_gathers_the_logits_of_the_rows_that_report_logprobs_only(calls: GroupCalls) -> None:
    """The ranks accept and draw a verify's tokens themselves; rank 0 reads a row's logits only for the logprobs its
    request reports. With none reported no logits are gathered (the result's are one NaN, holding no memory); with the
    row on rank 1 reporting them, that row's alone: the target logits its last token is the argmax of (greedy)."""
    batch = spread_batch(calls)
    prompt = calls.run(encode_prefill, list(range(2, 30)))
    (_, logits), _ = batch.join_many([(prompt.blocks, prompt.encoder_state)] * 2)  # one row on each rank
    greedy = SamplingParams.uniform(2)
    pending = [int(logits.argmax())] * 2
    for reported in ((False, False), (False, True)):
        sampling = StepSampling(greedy.temperature, greedy.top_k, greedy.top_p, logprobs=reported)
        draft = batch.dspark_draft(pending, sampling)
        result = batch.verify(pending, draft, sampling)
        assert result.logits.shape == (2, 1 + draft.tokens.shape[1], calls.model.args.vocab_size)
        assert result.logits[0].isnan().all()
        if reported[1]:
            accepted = int(result.accepted[1])
            assert result.logits[1].isfinite().all()
            assert result.tokens[1][-1] == int(result.logits[1, accepted].argmax())
        else:
            assert result.logits.untyped_storage().nbytes() == result.logits.element_size()
            assert result.logits.isnan().all()
        pending = [row[-1] for row in result.tokens]


def test_a_row_banning_tokens_is_masked_on_the_rank_holding_it(calls: GroupCalls) -> None:
    """A guide without a grammar travels with the plans: row 1 (on rank 1) banning the token it emits first when free
    drafts and verifies around it, while row 0 (free, the same prompt, on rank 0) emits the free tokens; a guide
    holding a grammar matcher cannot leave rank 0."""
    prompt = calls.run(encode_prefill, list(range(2, 30)))
    greedy = SamplingParams.uniform(2)

    def joined() -> tuple[SpreadBatch, list[int]]:
        batch = spread_batch(calls)
        (_, logits), _ = batch.join_many([(prompt.blocks, prompt.encoder_state)] * 2)  # one row on each rank
        return batch, [int(logits.argmax())] * 2

    def sampling(masks: Masks | None) -> StepSampling:
        return StepSampling(greedy.temperature, greedy.top_k, greedy.top_p, masks=masks)

    batch, pending = joined()
    free = batch.verify(pending, batch.dspark_draft(pending, sampling(None)), sampling(None))
    banned = free.tokens[1][0]
    batch, pending = joined()
    guides: list[Guide | None] = [None, Guide(None, banned=[banned])]
    draft = batch.dspark_draft(pending, sampling(Masks(guides)))
    drafts = draft.tokens.tolist()
    kept = [row[:n] for row, n in zip(drafts, admitted(guides, drafts), strict=True)]
    lengths = torch.tensor([len(row) for row in kept])
    result = batch.verify(pending, draft, sampling(Masks(guides, kept)), lengths)
    assert result.tokens[0] == free.tokens[0]
    assert banned not in result.tokens[1]
    grammars = Grammars(vocabulary(default_tokenizer(), calls.model.args.vocab_size))
    guides[1] = Guide(grammars.compile_now(decode_pb2.OutputConstraint(json_object=True)))
    with pytest.raises(ValueError, match="matcher cannot leave rank 0"):
        batch.dspark_draft(pending, sampling(Masks(guides)))
