"""The decode engine: continuous batching on one thread that owns the model.

    loop:  take aborts ─▶ admit waiting sequences (≤ max_batch a rank running) ─▶ one chunk of local prefill
           ─▶ one step of each lane ─▶ deliver tokens

- **Admit**: a handoff's blocks + encoder state join their lane's `DecodeBatch` at once (the decoder's bounded replay
  gives the first token's logits), together with the other handoffs taken in at that iteration: one replay forward
  per lane for all of them (`DecodeBatch.join_many`), whose fixed cost is most of a replay's. A token-ids prompt is
  PREFILLING first: decode encodes it itself on top of the cached prefix, ONE chunk per iteration for the first
  prefilling sequence (arrival order), so the running streams wait at most one chunk between two tokens
  (local_prefill.py; in a rank group on the rank it will join only); after its last chunk it joins its lane the same
  way.
- **Lanes**: DSpark rows (draft γ tokens, verify them losslessly, several tokens per step) and plain rows (one token
  per step): a request that turns speculation off, or every request under --no-speculation. A sampled row's tokens
  are fixed per output position by its seed (its request's, or one drawn at random: sampler.py), so seeded and
  unseeded, greedy and sampled requests share the speculative lane. Whether a speculative step drafts,
  and how many drafts it verifies, is DSpark's hardware-aware scheduler's call (scheduler.py), on the step times this
  engine measures (step_times.py: seeded by a short profile when the thread starts, then every step adds a sample):
  speculation must never make decoding slower.
- **Deliver**: a step's tokens go to their sequences' outboxes when the step ends (the streams send them), posted
  to the event loop in one wake-up for the whole batch (`Mail`); a stop token or the output budget finishes it. A
  finished sequence leaves its batch, and its new blocks + end-of-sequence SWA record are handed to `write_back`
  (asynchronous: the final message never waits for the cache).
- **Abort** (the RPC, a cancelled stream, the replica stopping) frees the sequence between two steps.

The RPC side talks to the thread through `register` / `submit` / `abort` (thread-safe); outputs flow back through
each sequence's `Outbox`. A failing step fails the sequences of its lane only; the engine keeps serving.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch
from torch import Tensor

from decode_svc.local_prefill import OnRank, Prefill, Restorable
from decode_svc.masking import admitted
from decode_svc.metrics import DecodeMetrics
from decode_svc.sampler import batch_sampling, sample_rows, token_logprobs, warm_race
from decode_svc.scheduler import DraftScheduler, Plan, bucket
from decode_svc.sequence import Delta, End, Failure, Lane, Mail, Sequence, State
from decode_svc.speculation import Calibration, draft_caps
from decode_svc.spread import SpreadBatch, new_batch, new_prefill
from decode_svc.step_times import Forward, StepTimes, profile
from model import DecodeBatch, EncoderState, GlobalKVBlock, ReadBack, Transformer
from model_service.ranks import LocalCalls, ModelCalls
from model_service.runtime import RequestError
from proto.decode.v1 import decode_pb2

# (sequence, the token ids its blocks and state cover, new complete blocks, end-of-sequence state or None)
WriteBack = Callable[[Sequence, list[int], list[GlobalKVBlock], EncoderState | None], None]


@dataclass(frozen=True)
class EngineSettings:
    max_batch: int
    max_queue: int
    speculation: bool
    max_draft: int
    draft_policy: str  # "measured": the hardware-aware scheduler on measured step times; "full": every draft
    chunk_size: int


class Engine:
    def __init__(
        self,
        model: Transformer,
        settings: EngineSettings,
        metrics: DecodeMetrics,
        log: Any,
        write_back: WriteBack,
        times: StepTimes | None = None,
        calls: ModelCalls | None = None,
    ) -> None:
        """`calls`: how the model is called (a rank group's rank 0 replicates every call; default: here only)."""
        self.model = model
        self.calls = calls if calls is not None else LocalCalls(model)
        self.settings = settings
        self.max_draft = min(settings.max_draft, model.args.dspark_block_size)
        self.capacity = settings.max_batch * self.calls.world_size  # rows running at once: max_batch per rank
        self.metrics = metrics
        self.log = log
        self.write_back = write_back
        self.batches: dict[Lane, DecodeBatch] = {lane: self._new_batch() for lane in Lane}
        self.rows: dict[Lane, dict[int, Sequence]] = {lane: {} for lane in Lane}  # seq id → sequence
        self.prefilling: dict[Sequence, Prefill] = {}  # PREFILLING sequences, in arrival order
        # What DSpark's drafts have been worth lately, to greedy rows (True) and to sampled ones (engine thread only).
        self.calibrations = {greedy: Calibration() for greedy in (True, False)}
        self.times = times if times is not None else StepTimes()  # what each forward costs here (engine thread only)
        self.scheduler = DraftScheduler(self.times, full=settings.draft_policy == "full")
        self.mail = Mail()  # what the streams get: sent after each step and a join, an abort or a failure at once
        # Shared with the RPC side, under the condition's lock:
        self._cond = threading.Condition(threading.RLock())
        self._registry: dict[str, Sequence] = {}  # live sequences by request id
        self._inbox: deque[Sequence] = deque()
        self._aborts: list[Sequence] = []
        self._running = 0  # sequences holding a batch slot: PREFILLING or RUNNING
        self._stopping = False
        self._broken: RequestError | None = None  # the replica failed: every request is refused with it
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self.warmed = threading.Event()  # set once the start-up captures and profile are done
        self.start_error: str | None = None  # why the start-up failed, when it did: the engine serves nothing then

    # ---------------------------------------------------------------------------------------- the RPC side
    @property
    def waiting(self) -> int:
        return len(self._registry) - self._running

    @property
    def running(self) -> int:
        return self._running

    def register(self, seq: Sequence) -> None:
        """Take a slot in the queue (RESOURCE_EXHAUSTED when full) before the prompt is restored."""
        with self._cond:
            if self._broken is not None:
                raise self._broken
            if seq.request_id in self._registry:
                raise RequestError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"a generation with request_id {seq.request_id!r} is already running here",
                    "duplicate",
                )
            if self.waiting >= self.settings.max_queue:
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.waiting} sequences are already waiting on this decode replica",
                    "overloaded",
                )
            self._registry[seq.request_id] = seq
            self._gauges()

    def submit(self, seq: Sequence) -> None:
        """Hand a registered sequence, its prompt ready, to the engine thread."""
        with self._cond:
            seq.submitted_at = time.monotonic()
            self._inbox.append(seq)
            self._cond.notify()

    def release(self, seq: Sequence, reason: str) -> None:
        """Its RPC ended: a sequence never submitted leaves the queue; one still live is aborted (its caller left)."""
        with self._cond:
            if seq.submitted_at is None:
                if seq.live:
                    self._unregister(seq, State.ABORTED)
                return
        if seq.live:
            self.abort(seq.request_id, reason)

    def abort(self, request_id: str, reason: str) -> bool:
        """Ask the engine to end a live sequence at its next step boundary; False if there is none."""
        with self._cond:
            seq = self._registry.get(request_id)
            if seq is None or seq.abort_reason:
                return seq is not None
            seq.abort_reason = reason
            self._aborts.append(seq)
            self._cond.notify()
            return True

    def fail_all(self, error: RequestError) -> None:
        """The replica failed (its rank group lost a rank): every live sequence ends with `error` now, whatever the
        engine thread is doing, and every later request is refused with it."""
        with self._cond:
            self._broken = error
            live = list(self._registry.values())
            self._cond.notify()
        for seq in live:
            seq.outbox.put(Failure(error.message, error.code))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """End every sequence still here (FINISH_REASON_ABORT) and stop the thread (waiting at most `timeout_s`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------------- the engine thread
    def warm_up(self) -> bool:
        """The start-up work before the first request: the step graphs captured, the keyed race compiled, the step
        times profiled (`warmed` set after, whatever happened); False where it failed (`start_error` says why: the
        engine serves nothing)."""
        try:
            self._capture()
            if self.start_error is None:
                warm_race(self.model.device, self.model.args.vocab_size)
                self._profile()
        finally:
            self.warmed.set()
        return self.start_error is None

    def _run(self) -> None:
        if not self.warm_up():
            return
        while self.iterate():
            pass
        with self._cond:
            left = [*self._inbox, *self.prefilling, *(s for lane in Lane for s in self.rows[lane].values())]
            self._inbox.clear()
        for seq in left:
            seq.abort_reason = seq.abort_reason or "shutdown"
            self._abort(seq)

    def iterate(self) -> bool:
        """One iteration of the engine thread's loop (waiting for work first); False once the engine is stopping.

        Tests drive an engine whose thread was never started with it, one deterministic iteration at a time."""
        with self._cond:
            while not self._stopping and not self._aborts and not self._running and not self._inbox:
                self._cond.wait()
            if self._stopping:
                return False
            aborts, self._aborts = self._aborts, []
            arrivals = []
            while self._inbox and self._running + len(arrivals) < self.capacity:
                arrivals.append(self._inbox.popleft())
        admitted = time.monotonic()
        for seq in aborts:
            self._abort(seq)
        handoffs = []
        for seq in arrivals:
            assert seq.submitted_at is not None  # every arrival came through submit()
            self.metrics.admit_wait.observe(admitted - seq.submitted_at)
            if self._admit(seq):
                handoffs.append(seq)
        self._join(handoffs)
        if self.prefilling:
            self._prefill_chunk()
        stepping = [lane for lane in Lane if len(self.batches[lane])]
        for lane in stepping:
            self._step(lane)
        if stepping:  # the calibrations forget per batch step, not per chunk of a prefill running alone
            for calibration in self.calibrations.values():
                calibration.tick()
        return True

    def _capture(self) -> None:
        """Capture every lane's step graphs before the first request (the replica reports SERVING once they and the
        profile are done: `warmed`): a lane's batch sizes up to max_batch, and the speculative lane's drafts and
        verify widths. A rank group's forwards run eagerly (their all-to-all sizes reach the host): nothing to
        capture. A failed capture fails the start (`start_error`): torch leaves the CUDA generator of a capture that
        did not begin in capture mode, so no random draw of the process would work after it."""
        if self.calls.world_size > 1:
            return
        for lane, batch in self.batches.items():
            widths = range(1, self.max_draft + 1) if lane is Lane.SPECULATIVE and self.settings.speculation else ()
            started = time.monotonic()

            def progress(done: int, total: int, lane: Lane = lane, started: float = started) -> None:
                seconds = round(time.monotonic() - started, 1)
                self.log.info("graphs_captured", lane=lane.value, buckets=f"{done}/{total}", seconds=seconds)

            try:
                batch.capture(widths, progress)
            except Exception as exc:  # a bug
                self.log.exception("capture_failed", lane=lane.value)
                self.start_error = f"the {lane.value} lane's step graphs could not be captured: {exc}"
                return

    def _profile(self) -> None:
        """Seed the step times DSpark's scheduler reads, before the first request."""
        if not self.settings.speculation or self.scheduler.full or self.times.measured(*Forward):
            return
        started = time.monotonic()
        try:
            self.calls.run(profile, self.times, self.max_draft)
        except Exception:  # a bug: the scheduler measures as it goes instead
            self.log.exception("profile_failed")
            return
        ms = {f.value: {n: round(s * 1e3, 2) for n, s in self.times.known(f).items()} for f in Forward}
        self.log.info("step_times", seconds=round(time.monotonic() - started, 3), ms_by_tokens=ms)

    def _admit(self, seq: Sequence) -> bool:
        """Take an arrival in; True for a handoff, which joins its lane with this iteration's other handoffs."""
        if seq.abort_reason:
            self._abort(seq)
            return False
        prompt = seq.prompt
        assert prompt is not None
        if prompt.restorable is not None:
            return True
        batch = self.batches[self._lane(seq)]
        self.prefilling[seq] = new_prefill(self.calls, batch, prompt.token_ids, prompt.past, self.settings.chunk_size)
        self._enter(seq, State.PREFILLING)
        return False

    def _prefill_chunk(self) -> None:
        """One chunk of the first prefilling sequence's prompt; after its last it joins its lane."""
        seq, prefill = next(iter(self.prefilling.items()))
        try:
            done = prefill.advance()
        except Exception as exc:  # a cached prefix that does not fit, or out of memory: this sequence only
            self.log.exception("local_prefill_failed", request_id=seq.request_id, position=prefill.position)
            del self.prefilling[seq]
            self._fail([seq], f"decode could not prefill the prompt: {exc}", exc)
            return
        self.metrics.local_prefill_chunks.inc()
        if not done:
            return
        del self.prefilling[seq]
        prompt, out = seq.prompt, prefill.output
        assert prompt is not None
        assert out is not None
        prompt.cached_tokens, prompt.bounded_replay = out.cached_tokens, out.bounded_replay
        self.metrics.local_prefills.labels(prompt.local_prefill).inc()
        if out.bounded_replay:
            self.metrics.bounded_replays.inc()
        self.log.info(
            "local_prefill",
            request_id=seq.request_id,
            reason=prompt.local_prefill,
            prompt=len(prompt.token_ids),
            cached=out.cached_tokens,
            chunks=prefill.chunks,
            seconds=round(prefill.seconds, 3),
        )
        self.write_back(seq, prompt.token_ids, out.blocks, None)  # what a prefill replica would have written
        prompt.prefilled = prefill.restorable
        self._join([seq])

    def _join(self, seqs: list[Sequence]) -> None:
        """Restore prompts into their lanes' batches and send each its first token: one decoder bounded replay
        forward per lane for all of them (a forward's fixed cost is most of a replay's on a small batch). If the
        batch cannot join (a corrupt or mismatched record), each tries alone, so only the one at fault fails."""
        for lane in Lane:
            joining = [seq for seq in seqs if self._lane(seq) is lane]
            if not joining:
                continue
            started = time.monotonic()
            try:
                joined = self.batches[lane].join_many([self._restorable(seq) for seq in joining])
            except Exception as exc:
                if len(joining) > 1:
                    for seq in joining:
                        self._join([seq])
                    continue
                self.log.exception("restore_failed", request_id=joining[0].request_id)
                self._fail(joining, f"decode could not restore the prompt: {exc}", exc)
                continue
            self.metrics.join.labels(lane.value).observe(time.monotonic() - started)
            self.metrics.join_size.labels(lane.value).observe(len(joining))
            self._start(lane, joining, joined)

    @staticmethod
    def _restorable(seq: Sequence) -> Restorable | OnRank:
        assert seq.prompt is not None
        assert seq.prompt.restorable is not None
        return seq.prompt.restorable

    def _lane(self, seq: Sequence) -> Lane:
        """Plain for a request that turns speculation off, and in a rank group for one under a grammar: its masks live
        in rank 0's grammar matcher, and only a plain step leaves every sampling decision to rank 0 (the other ranks
        run the tokens it chose). A guide without a grammar (banned tokens) travels with the plans instead."""
        grouped_guide = seq.guide is not None and not seq.guide.portable and self.calls.world_size > 1
        speculate = self.settings.speculation and seq.params.speculate and not grouped_guide
        return Lane.SPECULATIVE if speculate else Lane.PLAIN

    def _start(self, lane: Lane, seqs: list[Sequence], joined: list[tuple[int, Tensor]]) -> None:
        """Joined sequences become RUNNING rows of their lane and get their first tokens."""
        for seq, (seq_id, _) in zip(seqs, joined, strict=True):
            seq.seq_id, seq.lane = seq_id, lane
            self.rows[lane][seq_id] = seq
            self._enter(seq, State.RUNNING)
            seq.draft.prior = self.calibrations[seq.params.sampling.greedy].ratio
        try:
            logits = torch.stack([row for _, row in joined])
            tokens = sample_rows(logits, seqs)
            for b, seq in enumerate(seqs):
                self._deliver(seq, [tokens[b]], logits[b : b + 1])
        except Exception as exc:  # a bug or out of memory: these sequences only
            self.log.exception("first_token_failed", request_ids=[seq.request_id for seq in seqs])
            for seq in seqs:
                if seq.state is State.RUNNING:
                    self._leave(seq, State.FAILED)
            self._fail(seqs, f"decode could not sample the first token: {exc}")
        self.mail.send()

    def _step(self, lane: Lane) -> None:
        batch = self.batches[lane]
        rows = [self.rows[lane][seq_id] for seq_id in batch.seq_ids]
        pending = [seq.output[-1] for seq in rows]  # sampled, not yet run through the model
        started = time.monotonic()
        try:
            if lane is Lane.PLAIN:
                emitted, logits = self._plain_step(batch, rows, pending)
            else:
                emitted, logits = self._speculative_step(batch, rows, pending)
            self.metrics.step.labels(lane.value).observe(time.monotonic() - started)
            self.metrics.batch_size.labels(lane.value).observe(len(rows))
            for b, seq in enumerate(rows):
                self._deliver(seq, emitted[b], logits[b])
        except Exception as exc:  # a bug or out of memory: this lane's sequences fail, the engine goes on
            self.log.exception("step_failed", lane=lane.value, batch=len(rows))
            self._fail(rows, f"the decode engine failed: {exc}", exc)
            self.batches[lane], self.rows[lane] = self._new_batch(), {}
        self.mail.send()  # the lane's tokens go out before the next lane steps

    def _new_batch(self) -> DecodeBatch | SpreadBatch:
        """A lane's batch, holding max_batch rows (per rank of a group) from the start (its step graphs are never
        reallocated by a join)."""
        lanes, prefills = lambda: self.batches.values(), lambda: self.prefilling.values()
        return new_batch(self.calls, self.settings.max_batch, lanes, prefills, self.metrics.rank_rows)

    def _plain_step(self, batch: DecodeBatch, rows: list[Sequence], pending: list[int]):
        with self.times.timed(Forward.PLAIN, len(rows)):
            logits = batch.decode_step(pending)
            tokens = sample_rows(logits, rows)  # the step's one wait
        return [[t] for t in tokens], logits.unsqueeze(1)

    def _speculative_step(self, batch: DecodeBatch, rows: list[Sequence], pending: list[int]):
        """Draft if the scheduler says it pays, verify the width it chooses on the draft's confidences, commit. Where a
        verify of every draft costs no more than a narrow one (`DraftScheduler.ahead`) and the forward can take the
        drafts on the device (`DecodeBatch.chains`), the verify is queued right behind the draft at the widest width
        and accepts every draft the caps allow: the device never waits for the host."""
        m, records = self.metrics, [seq.draft for seq in rows]
        budgets = [min(self.max_draft, seq.limit - len(seq.output) - 1) for seq in rows]  # a step emits drafts + 1
        guides = [seq.guide for seq in rows]
        guided = any(g is not None for g in guides)
        chained = not guided and batch.chains()
        calibrations = [self.calibrations[seq.params.sampling.greedy] for seq in rows]
        greedy = all(seq.params.sampling.greedy for seq in rows)  # the batch's trust: all-greedy or with a sampled row
        forecasts = [r.forecast(self.max_draft, c.typical) for r, c in zip(records, calibrations, strict=True)]
        plan = self.scheduler.plan(forecasts, budgets, chained, greedy=greedy)
        m.draft_steps.labels(plan.value).inc()
        if plan is Plan.PLAIN:
            return self._waiting_step(batch, rows, pending)
        widest = max(budgets)
        ahead = chained and self.scheduler.ahead(len(rows), widest)
        with self.times.timed(Forward.DRAFT, len(rows)):
            draft = batch.dspark_draft(pending, batch_sampling(rows))
            head = slice(None), slice(0, self.max_draft)
            drafts = ReadBack(draft.confidence[head], draft.tokens[head])  # the draft's, queued before any verify
            launched = batch.verify_forward(pending, draft.trim(widest)) if ahead else None
            verify = None if guided else batch_sampling(rows)  # made while the draft runs (masks follow the drafts)
            confidence, drafted = drafts.lists()  # one wait: the draft has run
        caps = draft_caps(drafted, budgets, [s.params.stop_token_ids for s in rows])
        if guided:  # never past a draft the constraint refuses
            caps = [min(cap, n) for cap, n in zip(caps, admitted(guides, drafted), strict=True)]
        a = [r.drafted(c) for r, c in zip(records, confidence, strict=True)]
        width = max(caps, default=0) if launched is not None else self.scheduler.width(a, caps)
        m.verify_width.observe(width)
        if width == 0 and launched is None:  # not worth a verify column after all
            self._realised(len(rows), len(rows), 0, greedy)
            return self._waiting_step(batch, rows, pending)
        lengths = [min(width, cap) for cap in caps]
        columns = widest if launched is not None else width
        with self.times.timed(Forward.VERIFY, len(rows) * (1 + columns)):
            if verify is None:
                verify = batch_sampling(rows, [row[:n] for row, n in zip(drafted, lengths, strict=True)])
            if launched is None:
                host = replace(draft.trim(width), tokens=torch.tensor([row[:width] for row in drafted]))
                result = batch.verify(pending, host, verify, torch.tensor(lengths))  # read back inside
            else:
                result = batch.accept(launched, verify, torch.tensor(lengths))
        accepted = result.accepted.tolist()
        self._realised(len(rows), len(rows) + sum(accepted), columns, greedy)
        for r, c, n, k in zip(records, calibrations, lengths, accepted, strict=True):
            c.add(k, *r.record(n, k))
        m.draft_proposed.inc(sum(lengths))
        m.draft_accepted.inc(sum(accepted))
        m.speculative_steps.inc(len(rows))
        return result.tokens, result.logits

    def _waiting_step(self, batch: DecodeBatch, rows: list[Sequence], pending: list[int]):
        """A plain step of the speculative lane: its rows' forecasts age."""
        for seq in rows:
            seq.draft.waited()
        return self._plain_step(batch, rows, pending)

    def _realised(self, rows: int, tokens: int, width: int, greedy: bool) -> None:
        self.scheduler.realised(rows, tokens, width)
        draws = "greedy" if greedy else "sampled"
        self.metrics.draft_trust.labels(str(bucket(rows)), draws).set(self.scheduler.trust(rows, greedy))

    def _deliver(self, seq: Sequence, tokens: list[int], logits: Tensor) -> None:
        """Emit a step's tokens up to a stop token, the end of its output constraint's grammar (nothing may follow
        it, even where the request stops at no token) or the budget; finish the sequence there. A token its output
        constraint refuses (the masks make it impossible: a bug) fails the sequence: before it is sent where the
        guide can tell at once, else before the step's next tokens (the grammar's matcher takes a step's tokens while
        the next forward runs: guide.py)."""
        out: list[int] = []
        reason = None
        guide = seq.guide
        for token in tokens:
            if guide is not None and (guide.broken is not None or not guide.follow(token)):
                self._refused(seq, token if guide.broken is None else guide.broken)
                return
            out.append(token)
            if token in seq.params.stop_token_ids or (guide is not None and guide.complete):
                reason = decode_pb2.FINISH_REASON_STOP  # a stop token, or the one that completed the grammar
                break
            if len(seq.output) + len(out) >= seq.limit:
                reason = decode_pb2.FINISH_REASON_LENGTH
                break
        if reason is not None and guide is not None and (refused := guide.settle()) is not None:
            self._refused(seq, refused)  # the last tokens, taken now: no step follows them
            return
        seq.output += out
        p = seq.params
        logprobs = token_logprobs(logits, out, p.top_logprobs) if p.logprobs else None
        self.metrics.tokens.inc(len(out))
        self.mail.put(seq.outbox, Delta(out, logprobs))
        if reason is not None:
            self._finish(seq, reason)

    def _refused(self, seq: Sequence, token: int) -> None:
        self.log.error("constraint_broken", request_id=seq.request_id, token=token, position=len(seq.output))
        self._leave(seq, State.FAILED)
        self._fail([seq], f"token {token} breaks the output constraint")

    def _finish(self, seq: Sequence, reason: decode_pb2.FinishReason.ValueType) -> None:
        export = self._leave(seq, State.FINISHED)
        assert seq.prompt is not None
        # Verification committed the prompt and the emitted tokens, but for the last one unless it was a draft.
        covered = (seq.prompt.token_ids + seq.output)[: export.encoder_state.position]
        self.write_back(seq, covered, export.blocks, export.encoder_state)
        self.mail.put(seq.outbox, End(reason, seq.usage()))

    def _abort(self, seq: Sequence) -> None:
        if not seq.live:
            return
        if seq.state is State.RUNNING:
            self._leave(seq, State.ABORTED)
        else:
            self.prefilling.pop(seq, None)
            self._unregister(seq, State.ABORTED)
        self.metrics.aborts.labels(seq.abort_reason).inc()
        self.log.info("aborted", request_id=seq.request_id, reason=seq.abort_reason, tokens=len(seq.output))
        self.mail.put(seq.outbox, End(decode_pb2.FINISH_REASON_ABORT, seq.usage()))
        self.mail.send()  # at once, as a failure (`_fail`)

    def _fail(self, rows: list[Sequence], message: str, cause: Exception | None = None) -> None:
        """End `rows` with an error: INTERNAL, or the status of a `RequestError` cause (UNAVAILABLE: the replica's
        rank group failed, so another replica may serve them). Sent at once, after what was put before it: a sequence
        leaves the registry here, so a failing group's `fail_all` no longer reaches it, and the replica may stop
        before the step ends."""
        code = cause.code if isinstance(cause, RequestError) else grpc.StatusCode.INTERNAL
        if isinstance(cause, RequestError):
            message = cause.message
        for seq in rows:
            if seq.live or seq.state is State.FAILED:
                self._unregister(seq, State.FAILED)
                self.mail.put(seq.outbox, Failure(message, code))
        self.mail.send()

    def _leave(self, seq: Sequence, state: State):
        assert seq.lane is not None
        export = self.batches[seq.lane].leave(seq.seq_id)
        del self.rows[seq.lane][seq.seq_id]
        self._unregister(seq, state)
        return export

    def _unregister(self, seq: Sequence, state: State) -> None:
        with self._cond:  # re-entrant: `release` holds it already
            if self._registry.get(seq.request_id) is seq:
                del self._registry[seq.request_id]
            self._enter(seq, state)

    def _enter(self, seq: Sequence, state: State) -> None:
        """Every state change: the slot count (PREFILLING and RUNNING hold one) and the gauges follow it."""
        with self._cond:
            self._running += state.holds_slot - seq.state.holds_slot
            seq.state = state
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(self.waiting)
        self.metrics.running.set(self._running)
