"""Local prefill in chunks: decode's own encoder pass over a token-ids prompt, interleaved with the batch's steps.

A token-ids prompt (the gateway's fallback when no prefill replica or handoff is available, a decode-only
deployment, a handoff whose blocks went missing) is encoded here, on the engine thread that also steps the batch. Run
in one piece it would stall every running stream for the whole prompt; so, as vLLM's and SGLang's chunked prefill
do, the engine advances it by one chunk (`--chunk-size` tokens) per iteration and steps the lanes in between: a
running stream waits at most one chunk between two tokens.

The chunks are those of one `encode_with_past` over the whole prompt: the same `model.PrefillRun` (one encoder cache
row, restored from the cached prefix once) advanced between the batch's steps instead of in one loop, so the blocks
and the final state are the same, byte for byte (tests/decode_svc/test_local_prefill.py). In a rank group the chunks
run on the one rank the sequence will join (decode_svc.spread.SpreadPrefill), not on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from model import EncoderState, GlobalKVBlock, Past, PrefillOutput, PrefillRun, Transformer
from model_service.kvstore import start_prefill

Restorable = tuple[list[GlobalKVBlock], EncoderState]  # a prefilled prompt, as it joins a batch


@dataclass(frozen=True)
class OnRank:
    """A prompt one rank of a group prefilled itself (decode_svc.spread.SpreadPrefill): it joins that rank."""

    rank: int
    prompt: Restorable


class Prefill:
    """A token-ids prompt decode prefills itself on top of what the cache held (`past`), a chunk per `advance`:
    what the engine reads of it, wherever its chunks run."""

    def __init__(self, past: Past | None) -> None:
        self.past = past
        self.output: PrefillOutput | None = None  # the new blocks and the encoder state, once done
        self.chunks = 0
        self.seconds = 0.0  # spent on its chunks so far

    @property
    def position(self) -> int:
        """Tokens encoded so far (the cached prefix included; 0 before the first chunk)."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.output is not None

    @property
    def cached_blocks(self) -> list[GlobalKVBlock]:
        return self.past.blocks if self.past is not None else []

    @property
    def restorable(self) -> Restorable | OnRank:
        """What its sequence joins its lane's batch from, once done."""
        return self._prompt()

    def _prompt(self) -> Restorable:
        """The prefilled prompt: the cached blocks and the new ones, and the encoder state."""
        assert self.output is not None
        return self.cached_blocks + self.output.blocks, self.output.encoder_state

    def advance(self) -> bool:
        """Encode the next chunk; True once the whole prompt is encoded."""
        started = time.monotonic()
        self._chunk()
        self.chunks += 1
        self.seconds += time.monotonic() - started
        return self.done

    def _chunk(self) -> None:
        raise NotImplementedError


class LocalPrefill(Prefill):
    """A prompt encoded in this process, by one `model.PrefillRun` advanced a chunk at a time."""

    def __init__(self, model: Transformer, token_ids: list[int], past: Past | None, chunk_tokens: int) -> None:
        super().__init__(past)
        self.model = model
        self.token_ids = token_ids
        self.chunk_tokens = chunk_tokens
        self.run: PrefillRun | None = None  # started by the first chunk: restoring the cached prefix is its work

    @property
    def position(self) -> int:
        return self.run.position if self.run is not None else 0

    def _chunk(self) -> None:
        """The first chunk starts from the cached prefix: its SWA record, or a bounded replay of the encoder rings when
        there is none — or when the record turns out not to fit these tokens, in which case the chunks start at the
        last cached block instead."""
        if self.run is None:
            self.run = start_prefill(self.model, self.token_ids, self.past, self.chunk_tokens)
        if not self.run.done:
            self.run.advance()
        if self.run.done:
            self.output, self.run = self.run.output(), None  # its cache row is no longer needed
