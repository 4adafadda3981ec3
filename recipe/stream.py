"""The stream processor: backend output (text chunks or token ids) → protocol events and response.

Text mode (no tokenizer) takes decoded text; token mode takes token ids, detokenises them
incrementally (never splitting a UTF-8 character) and lets the template tokens `</think>` and
`｜DSML｜` reach the parser as markers only when the model emitted those very tokens. Logprobs follow
their token: each is reported with the first reasoning or answer text that came from it (tokens whose
text the parser swallowed, such as markers, report none).

`MultiChoiceProcessor` runs one processor per choice for Chat Completions `n > 1`.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from recipe.errors import RecipeError
from recipe.options import ConvertedRequest
from recipe.parser import Markers, Out, Parser, Stage
from recipe.response.chat import ChatWriter, usage_body
from recipe.response.events import DONE, Event, Finish, Meta, Usage, encode, logprob_entry
from recipe.response.messages import MessagesWriter
from recipe.response.responses import ResponsesWriter
from recipe.response.writer import Writer
from recipe.tokenizer import Tokenizer

BackendFinish = Literal["stop", "length", "content_filter"]
# One (logprob, [(token id, logprob), ...]) pair per token id.
TokenLogprobs = Sequence[tuple[float, Sequence[tuple[int, float]]]]

# Unicode noncharacters stand for the marker tokens inside token-mode text.
THINK_END_SENTINEL = "\ufdd0"
DSML_SENTINEL = "\ufdd1"
TOKEN_MARKERS = Markers(think_end=THINK_END_SENTINEL, dsml=DSML_SENTINEL)

# Enum members looked up per chunk (a class lookup costs ~90 ns on Python 3.11).
_REASONING, _TOOL_START, _TOOL_END = Stage.REASONING, Out.TOOL_START, Out.TOOL_END
_BACKEND_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "content_filter": Finish.CONTENT_FILTER}
_ID_PREFIX = {"chat.completions": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


def new_id(api: str) -> str:
    return _ID_PREFIX[api] + uuid.uuid4().hex


def _call_id(api: str, index: int) -> str:
    return ("toolu_" if api == "messages" else f"call_{index:02d}_") + secrets.token_hex(12)


class _PendingToken:
    """A token whose logprob waits for the first output its text produces: input range [start, end)."""

    __slots__ = ("end", "entries", "start")

    def __init__(self, start: int, end: int, entries: list[dict[str, Any]]) -> None:
        self.start, self.end, self.entries = start, end, entries


class StreamProcessor:
    """Push backend output, get protocol events; `response()` is the complete (non-streaming) body.

    request: the converted request (its API picks the event format).
    tokenizer: enables `push_tokens` (token mode); without it, `push_text`.
    id / created / model: what responses report (defaults: a new id, now, the requested model).
    stream: build stream events (default: the request's `stream`); without, only `response()` is built.
    signature: Messages only: the thinking-block signature (default: the response id).
    """

    def __init__(
        self,
        request: ConvertedRequest,
        *,
        tokenizer: Tokenizer | None = None,
        id: str | None = None,
        created: int | None = None,
        model: str | None = None,
        stream: bool | None = None,
        signature: str | None = None,
        index: int = 0,
        final_usage: bool = True,
    ) -> None:
        self.request = request
        self.tokenizer = tokenizer
        meta = Meta(id or new_id(request.api), model or request.model)
        if created is not None:
            meta.created = created
        stream = request.stream if stream is None else stream
        self.writer = _writer(request, meta, stream, signature, index, final_usage)
        self.track = tokenizer is not None and request.sampling.logprobs
        if tokenizer is None:
            self.parser = Parser(request.parsing)
        else:
            tokens = tokenizer.tokens
            restore = {THINK_END_SENTINEL: tokens.think_end, DSML_SENTINEL: tokens.dsml}
            self.parser = Parser(request.parsing, TOKEN_MARKERS, restore, track=self.track)
            self._markers = {
                tokenizer.special_id(tokens.think_end): THINK_END_SENTINEL,
                tokenizer.special_id(tokens.dsml): DSML_SENTINEL,
            }
            self._stop_ids = frozenset(request.stop_token_ids)
            self._step, self._hf = tokenizer.decode_stream().step, tokenizer.hf  # the incremental decoder
            self._pending: list[_PendingToken] = []
            self._carry: list[dict[str, Any]] = []
        self.started = False
        self.finished = False
        # Started and not finished, in text / token mode: the first test of push_text / push_tokens.
        self._text_open = self._tokens_open = False
        self.usage = Usage()
        self._calls = 0
        # The writer of each kind of text, called with the text alone on the fast path.
        writer = self.writer
        self._text_writers = {Out.CONTENT: writer.content, Out.REASONING: writer.reasoning, Out.ARGS: writer.tool_args}

    # -- input ------------------------------------------------------------------------------------------

    def start(
        self, prompt_tokens: int = 0, cached_tokens: int = 0, system_fingerprint: str | None = None
    ) -> list[Event]:
        """The opening events; call once the backend has accepted the prompt (pushes start implicitly)."""
        if self.started:
            return []
        self.started = True
        self._text_open = self.tokenizer is None
        self._tokens_open = not self._text_open
        self.usage.prompt_tokens, self.usage.cached_tokens = prompt_tokens, cached_tokens
        self.writer.meta.system_fingerprint = system_fingerprint
        return self.writer.start(self.usage)

    def push_text(self, text: str, token_count: int = 0) -> list[Event]:
        """Feed decoded output text that accounts for `token_count` completion tokens."""
        if not self._text_open:
            if self.tokenizer is not None:
                raise RecipeError("push_text needs a processor made without a tokenizer; use push_tokens", status=500)
            if self.finished:
                return []
            return self.start() + self.push_text(text, token_count)
        parser, usage = self.parser, self.usage
        usage.completion_tokens += token_count
        if parser.stage is _REASONING:
            usage.reasoning_tokens += token_count
        kind = parser.feed_plain(text)
        if kind is not None:  # the common case: reasoning or answer text without a marker character
            return self._text_writers[kind](text)
        items = parser.feed(text)
        if len(items) == 1:  # one piece of text (a stop would add its own item)
            kind, piece = items[0]
            write = self._text_writers.get(kind)
            if write is not None:
                return write(piece)
        elif not items:  # inside tool-call markup, most chunks
            return []
        events = self._dispatch(items, None)
        if parser.stop_sequence is not None:
            events += self._end(Finish.STOP_SEQUENCE)
        return events

    def push_tokens(self, token_ids: Sequence[int], logprobs: TokenLogprobs | None = None) -> list[Event]:
        """Feed generated token ids, with one `(logprob, top_logprobs)` pair per id if the request asked."""
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise RecipeError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens", status=500)
        if not self._tokens_open:
            if self.tokenizer is None:
                raise RecipeError("push_tokens needs a processor made with a tokenizer", status=500)
            if self.finished:
                return []
            return self.start() + self.push_tokens(token_ids, logprobs)
        events: list[Event] = []
        parser, usage, markers = self.parser, self.usage, self._markers
        entries = None if logprobs is None else iter(logprobs)
        for token_id in token_ids:
            entry = None if entries is None else next(entries)
            usage.completion_tokens += 1
            if parser.stage is _REASONING:
                usage.reasoning_tokens += 1
            if token_id in self._stop_ids:
                continue
            text = markers.get(token_id)
            if text is None:
                text = self._step(self._hf, token_id) or ""
            if self.track:
                start = parser.fed
                items = parser.feed(text)
                if entry is not None:
                    self._queue(token_id, entry, start, start + len(text))
                events += self._dispatch(items, self._attribute())
                continue
            kind = parser.feed_plain(text)
            if kind is not None:  # the common case: reasoning or answer text without a marker character
                events += self._text_writers[kind](text)
                continue
            items = parser.feed(text)
            if items:  # (inside tool-call markup most tokens give none)
                events += self._dispatch(items, None)
        if parser.stop_sequence is not None:
            events += self._end(Finish.STOP_SEQUENCE)
        return events

    def finish(self, reason: BackendFinish | None = "stop", usage: Usage | None = None) -> list[Event]:
        """End the output: the backend's finish reason (None: the stream just ended) and, optionally, its usage
        (prompt, cached and completion tokens; counted completion tokens are used otherwise)."""
        events = self.start() if not self.started else []
        if self.finished:
            return events
        items = self.parser.finish()
        events += self._dispatch(items, self._attribute() if self.track else None)
        if usage is not None:
            self.usage = Usage(
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens or self.usage.completion_tokens,
                usage.reasoning_tokens or self.usage.reasoning_tokens,
            )
        if reason is None:
            finish = Finish.END_OF_STREAM
        else:
            finish = _BACKEND_FINISH[reason]
            if finish is Finish.STOP and self.parser.tool_calls:
                finish = Finish.TOOL_CALLS
        return events + self._end(finish)

    def fail(self, message: str) -> list[Event]:
        """A backend failure mid-stream: the API's error event(s); the processor is finished."""
        events = self.start() if not self.started else []
        if self.finished:
            return events
        self.finished = True
        self._text_open = self._tokens_open = False
        return events + self.writer.fail(message)

    def response(self) -> dict[str, Any]:
        """The complete response body (after `finish`)."""
        return self.writer.response()

    # -- internals --------------------------------------------------------------------------------------

    def _end(self, finish: Finish) -> list[Event]:
        self.finished = True
        self._text_open = self._tokens_open = False
        return self.writer.finish(finish, self.parser.stop_sequence, self.usage)

    def _dispatch(self, items: list[tuple[Out, str]], logprobs: dict[Out, list[dict[str, Any]]] | None) -> list[Event]:
        events: list[Event] = []
        writer: Writer = self.writer
        for kind, text in items:
            write = self._text_writers.get(kind)
            if write is not None:
                entries = logprobs.pop(kind, None) if logprobs else None  # reasoning and answer text only
                events += write(text, entries) if entries else write(text)
            elif kind is _TOOL_START:
                events += writer.tool_start(self._calls, _call_id(self.request.api, self._calls), text)
                self._calls += 1
            elif kind is _TOOL_END:
                events += writer.tool_end()
        return events

    def _queue(self, token_id: int, logprob: tuple[float, Sequence[tuple[int, float]]], start: int, end: int) -> None:
        token_bytes = self.tokenizer.token_bytes  # type: ignore[union-attr]
        value, top = logprob
        entry = logprob_entry(token_bytes(token_id), value, [(token_bytes(t), lp) for t, lp in top])
        if start == end:
            # Part of a character still being decoded: it reports with the token that completes it.
            self._carry.append(entry)
            return
        self._pending.append(_PendingToken(start, end, [*self._carry, entry]))
        self._carry = []

    def _attribute(self) -> dict[Out, list[dict[str, Any]]]:
        """Logprobs of the tokens whose first output came out in the last feed, by output kind."""
        found: dict[Out, list[dict[str, Any]]] = {}
        pending = self._pending
        for kind, start, end in self.parser.spans:
            while pending and pending[0].end <= start:
                pending.pop(0)  # its text produced no output: markers, skipped newlines
            while pending and pending[0].start < end:
                found.setdefault(kind, []).extend(pending.pop(0).entries)
        # Tokens consumed without producing output never report (markers, skipped newlines).
        resolved = self.parser.resolved
        while pending and pending[0].end <= resolved:
            pending.pop(0)
        return found


def _writer(
    request: ConvertedRequest, meta: Meta, stream: bool, signature: str | None, index: int, final: bool
) -> Writer:
    if request.api == "chat.completions":
        return ChatWriter(request, meta, stream=stream, index=index, final_usage=final)
    if request.api == "responses":
        return ResponsesWriter(request, meta, stream=stream)
    return MessagesWriter(request, meta, stream=stream, signature=signature)


class MultiChoiceProcessor:
    """Chat Completions with `n` choices: one processor (and parser) per choice; route output by index.

    Each choice streams its own chunks (`choices[0].index` = the choice); when the last choice finishes,
    a usage chunk (`choices: []`) and `[DONE]` follow. `response()` holds every choice and the summed usage.
    """

    def __init__(
        self,
        request: ConvertedRequest,
        *,
        tokenizer: Tokenizer | None = None,
        id: str | None = None,
        created: int | None = None,
        model: str | None = None,
        stream: bool | None = None,
    ) -> None:
        if request.api != "chat.completions":
            raise ValueError("several choices exist only in Chat Completions")
        self.request = request
        self.id = id or new_id(request.api)
        self.choices = [
            StreamProcessor(
                request, tokenizer=tokenizer, id=self.id, created=created, model=model, stream=stream, index=i,
                final_usage=False,
            )
            for i in range(request.sampling.n)
        ]  # fmt: skip
        self.stream = self.choices[0].writer.stream
        self._closed = False

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def start(
        self, prompt_tokens: int = 0, cached_tokens: int = 0, system_fingerprint: str | None = None
    ) -> list[Event]:
        events = []
        for choice in self.choices:
            events += choice.start(prompt_tokens, cached_tokens, system_fingerprint)
        return events

    def push_text(self, choice: int, text: str, token_count: int = 0) -> list[Event]:
        return self._after(self.choices[choice].push_text(text, token_count))

    def push_tokens(self, choice: int, token_ids: Sequence[int], logprobs: TokenLogprobs | None = None) -> list[Event]:
        return self._after(self.choices[choice].push_tokens(token_ids, logprobs))

    def finish(self, choice: int, reason: BackendFinish | None = "stop", usage: Usage | None = None) -> list[Event]:
        return self._after(self.choices[choice].finish(reason, usage))

    def fail(self, message: str) -> list[Event]:
        events = self.choices[0].fail(message)
        for choice in self.choices[1:]:
            choice.finished = True
        return events

    def _after(self, events: list[Event]) -> list[Event]:
        if not self.finished or not self.stream or self._closed:
            return events
        self._closed = True
        writer = self.choices[0].writer
        assert isinstance(writer, ChatWriter)
        usage = usage_body(self.usage(), writer.thinking)
        return [
            *events,
            Event(None, writer.chunk_head()[:-1] + b'[],"usage":' + encode(usage) + b"}"),
            Event(None, DONE),
        ]

    def usage(self) -> Usage:
        first = self.choices[0].usage
        return Usage(
            first.prompt_tokens,
            first.cached_tokens,
            sum(c.usage.completion_tokens for c in self.choices),
            sum(c.usage.reasoning_tokens for c in self.choices),
        )

    def response(self) -> dict[str, Any]:
        body = self.choices[0].response()
        body["choices"] = [c.writer.choice() for c in self.choices]  # type: ignore[attr-defined]
        body["usage"] = usage_body(self.usage(), self.choices[0].writer.thinking)
        return body
