"""One generation inside the decode engine: its validated request, what its prompt restores from, its state, and the
outbox its gRPC stream reads.

    WAITING ──admit: handoff─────────────────────────────▶ RUNNING ──stop token / max_tokens──▶ FINISHED
     │  │                                                   ▲  │
     │  └─admit: token ids──▶ PREFILLING ──last chunk───────┘  │
     │                          │                              │
     └──────────────────────────┴──────────────────────────────┴──Abort, client gone, replica stopping──▶ ABORTED
                                                                                (engine error ──▶ FAILED)

Every transition happens on the engine thread (`Engine._enter`), except that a sequence never submitted (its prompt
could not be restored, its caller left first) simply leaves the registry. A PREFILLING sequence holds its batch slot
while decode encodes its prompt a chunk per engine iteration (local_prefill.py). The outbox carries what the stream
sends: token deltas, then one `End`, or a `Failure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import secrets
from dataclasses import dataclass, field

import grpc

from decode_svc.guide import Guide
from decode_svc.local_prefill import OnRank, Restorable
from decode_svc.speculation import DraftRecord
from model import EncoderState, GlobalKVBlock, Past
from proto.decode.v1 import decode_pb2

TopLogprobs = list[tuple[int, float]]
TokenLogprob = tuple[float, TopLogprobs]


class State(enum.Enum):
    WAITING = "waiting"  # registered: its prompt is being fetched, or it waits for a batch slot
    PREFILLING = "prefilling"  # holds a batch slot; decode encodes its token-ids prompt, a chunk per iteration
    RUNNING = "running"  # in a lane of the batch
    FINISHED = "finished"  # a stop token or max_tokens; its state is being written back
    ABORTED = "aborted"  # Abort, its caller gone, or the replica stopping
    FAILED = "failed"  # the engine failed while running it

    @property
    def live(self) -> bool:
        return self in (State.WAITING, State.PREFILLING, State.RUNNING)

    @property
    def holds_slot(self) -> bool:
        """Counts against --max-batch (and in the `running` gauge): it is in the batch or will join it."""
        return self in (State.PREFILLING, State.RUNNING)


class Lane(enum.Enum):
    """Sequences decoded by DSpark draft + verify, and those that turned speculation off (one token per step)."""

    SPECULATIVE = "speculative"
    PLAIN = "plain"


@dataclass(frozen=True)
class Sampling:
    temperature: float  # 0 = greedy
    top_p: float  # 1 = off
    top_k: int  # 0 = off
    seed: int | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Params:
    """A validated GenerateRequest, minus its prompt."""

    request_id: str
    sampling: Sampling
    stop_token_ids: frozenset[int]
    max_tokens: int  # 0 = up to the model's context
    logprobs: bool
    top_logprobs: int
    speculate: bool
    salt: bytes


@dataclass
class Prompt:
    """What the engine restores a sequence from: a prefill's handoff (`blocks` + `state`), or token ids it prefills
    itself on top of a cached prefix (`past`; `prefilled` once done)."""

    token_ids: list[int]
    blocks: list[GlobalKVBlock] | None = None
    state: EncoderState | None = None
    past: Past | None = None
    cached_tokens: int = 0
    bounded_replay: bool = False
    local_prefill: str = ""  # why decode prefills it itself ("" = it comes from a handoff)
    prefilled: Restorable | OnRank | None = None  # decode's own prefill of it, once done (`Prefill.restorable`)

    @property
    def restorable(self) -> Restorable | OnRank | None:
        """What a batch restores it from: a prefill's handoff (blocks, state), or decode's own prefill once done."""
        if self.prefilled is not None:
            return self.prefilled
        return (self.blocks, self.state) if self.blocks is not None and self.state is not None else None


@dataclass
class Delta:
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass
class End:
    reason: decode_pb2.FinishReason.ValueType
    usage: decode_pb2.Usage


@dataclass
class Failure:
    message: str
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL  # UNAVAILABLE: the replica failed, another one may serve it


Item = Delta | End | Failure


class Outbox:
    """Engine thread → the RPC's event loop. `get()` waits for the next items and takes every one queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> None:
        """Thread-safe; dropped when the loop is gone (the server stopped)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def put_here(self, item: Item) -> None:
        """On the loop's own thread."""
        self._queue.put_nowait(item)

    async def get(self) -> list[Item]:
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


class Mail:
    """What the engine thread sends the streams during one step (or one phase of an iteration), posted to each event
    loop in one wake-up by `send`, in the order put. A wake-up per item would be a write to the loop's self-pipe per
    row and token: a system call that releases the GIL, which the loop's thread (woken by the first) then holds
    while the engine thread waits to launch its next step."""

    def __init__(self) -> None:
        self._items: list[tuple[Outbox, Item]] = []

    def put(self, outbox: Outbox, item: Item) -> None:
        self._items.append((outbox, item))

    def send(self) -> None:
        """Post what was put since the last send; dropped for a loop that is gone (the server stopped)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Outbox, Item]]] = {}
        for outbox, item in self._items:
            by_loop.setdefault(outbox.loop, []).append((outbox, item))
        self._items = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Outbox, Item]]) -> None:
    for outbox, item in items:
        outbox.put_here(item)


@dataclass(eq=False)
class Sequence:
    params: Params
    outbox: Outbox
    prompt: Prompt | None = None
    state: State = State.WAITING
    lane: Lane | None = None
    seq_id: int = -1  # its id in its lane's DecodeBatch
    limit: int = 0  # most tokens it may emit (its max_tokens, or what the context leaves)
    output: list[int] = field(default_factory=list)
    submitted_at: float | None = None  # when it was handed to the engine thread (time.monotonic); None: not yet
    abort_reason: str = ""  # set (by any thread) to ask the engine to abort it
    draft: DraftRecord = field(default_factory=DraftRecord)
    guide: Guide | None = None  # its output constraint (engine thread only, once submitted)
    writebacks: list[asyncio.Task[None]] = field(default_factory=list)  # its writes to the cache (event loop only)
    noise_seed: int = field(init=False)  # what keys its sampled tokens' noise (sampler.py): its request's seed, or any

    def __post_init__(self) -> None:
        seed = self.params.sampling.seed
        self.noise_seed = seed if seed is not None else secrets.randbits(63)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def live(self) -> bool:
        return self.state.live

    def usage(self) -> decode_pb2.Usage:
        prompt = self.prompt or Prompt([])
        return decode_pb2.Usage(
            prompt_tokens=len(prompt.token_ids),
            cached_tokens=prompt.cached_tokens,
            completion_tokens=len(self.output),
            draft_tokens_proposed=self.draft.proposed,
            draft_tokens_accepted=self.draft.accepted,
            bounded_replay=prompt.bounded_replay,
        )
