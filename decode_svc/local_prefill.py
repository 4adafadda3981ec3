"""Local prefill in chunks: decode's own encoder pass over a token-ids prompt, interleaved with the batch's steps.

A token-ids prompt (the gateway's fallback when no prefill replica or handoff is available, a decode-only
deployment, a handoff whose blocks went missing) is encoded here, on the engine thread that also steps the batch. Run
in one piece it would stall every running stream for the whole prompt; so, as vLLM's and SGLang's chunked prefill
do, the engine advances it by one chunk (`--chunk-size` tokens) per iteration and steps the lanes in between: a
running stream waits at most one chunk between two tokens.

Resuming is exact: the encoder state after a chunk (SWA rings, compressor partial groups, the partial tail block,
H^{L/2} of the last W tokens) is what an SWA record holds, and `encode_prefill` continues from
Past(blocks so far, that state) exactly as a conversation's next turn does (model/serving.py). The chunk
boundaries are those of one `encode_with_past` over the whole prompt with the same chunk size, so the blocks and the
final state are the same, byte for byte (tests/decode_svc/test_local_prefill.py).
"""

from __future__ import annotations

import time

from mesh.model_service.kvstore import encode_with_past
from model import EncoderState, GlobalKVBlock, Past, Transformer


class LocalPrefill:
    """One prompt's encoder pass on top of what the cache held (`past`), advanced a chunk at a time."""

    def __init__(self, model: Transformer, token_ids: list[int], past: Past | None, chunk_tokens: int) -> None:
        self.model = model
        self.token_ids = token_ids
        self.past = past
        self.chunk_tokens = chunk_tokens
        self.blocks: list[GlobalKVBlock] = []  # new complete blocks so far (indices from the cached ones on)
        self.state: EncoderState | None = None  # the encoder state where the chunks so far end
        self.chunks = 0
        self.seconds = 0.0  # spent in the encoder so far
        self.cached_tokens = 0  # prompt tokens covered by cached blocks (set by the first chunk)
        self.bounded_replay = False  # the cached prefix's encoder rings were rebuilt by bounded replay

    @property
    def position(self) -> int:
        """Where the next chunk starts."""
        if self.state is not None:
            return self.state.position
        if self.past is None:
            return 0
        if self.past.encoder_state is not None:
            return self.past.encoder_state.position
        return len(self.past.blocks) * self.model.args.kv_block_tokens

    @property
    def done(self) -> bool:
        return self.state is not None and self.state.position == len(self.token_ids)

    @property
    def cached_blocks(self) -> list[GlobalKVBlock]:
        return self.past.blocks if self.past is not None else []

    def advance(self) -> bool:
        """Encode the next chunk; True once the whole prompt is encoded.

        The first chunk starts from the cached prefix: its SWA record, or a bounded replay of the encoder rings when
        there is none — or when the record turns out not to fit these tokens, in which case that chunk also covers
        the tokens between the last cached block and the record (fewer than one block)."""
        started = time.monotonic()
        end = min(self.position + self.chunk_tokens, len(self.token_ids))
        first = self.state is None
        resume = self.past if first else Past(self.cached_blocks + self.blocks, self.state)
        out = encode_with_past(self.model, self.token_ids[:end], resume, self.chunk_tokens)
        if first:
            self.cached_tokens, self.bounded_replay = out.cached_tokens, out.bounded_replay
        self.blocks += out.blocks
        self.state = out.encoder_state
        self.chunks += 1
        self.seconds += time.monotonic() - started
        return self.done
