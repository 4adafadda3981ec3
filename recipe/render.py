"""Conversation → DeepSeek V4 / V4.1 prompt, as text and (with a tokenizer) token ids.

The prompt is built as a list of pieces: plain `str` text, or a `Special` template token. Token ids
encode every run of plain text as plain BPE and every template token as its added-vocabulary id, so a
user who types `<｜User｜>` gets the ids of those characters, never the control token.

Request prompts follow deepseek-recipe 0.2.0: in thinking mode the reasoning of earlier assistant turns
is dropped unless the request declares tools. `render_history` renders a finished conversation for
training, as the official encoder does: reasoning is kept for the turns after the last user message,
there is no generation header, and the spans the model must learn to produce are returned.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from recipe import pyjson
from recipe.conversation import (
    Assistant,
    Content,
    Conversation,
    Image,
    Message,
    System,
    Tool,
    ToolCall,
    ToolResult,
    User,
)
from recipe.templates import SCHEMA_FORMAT_HEAD, TOOLS_TAIL, V4_JSON_OBJECT_FORMAT, effort_line, tools_head
from recipe.tokens import DEFAULT_TOKENS, ModelVersion, SpecialTokens

if TYPE_CHECKING:
    from recipe.tokenizer import Tokenizer

UNSUPPORTED_IMAGE = "[Unsupported Image]"
_USER_TURN = (User, ToolResult)
_decode_json = msgspec.json.decode
_encode_json = msgspec.json.encode


class Special(str):
    """A template token among a prompt's pieces (plain text pieces are ordinary `str`)."""

    __slots__ = ()


class RenderedPrompt:
    """A rendered prompt.

    text: the prompt.
    images: the images, in the order of their placeholders.
    token_ids: the prompt's token ids (only when rendered with a tokenizer).
    assistant_spans: `render_history` only: `(start, end)` ranges of `token_ids` (of `text` without a
        tokenizer) that the assistant produced: reasoning, `</think>`, answer, tool calls and EOS.
    special_ranges: `(start, end)` code-point ranges of `text` that are template tokens.
    """

    def __init__(self, pieces: list[str], images: list[Image]) -> None:
        self.pieces = pieces
        self.text = "".join(pieces)
        self.images = images
        self.token_ids: list[int] | None = None
        self.assistant_spans: list[tuple[int, int]] | None = None

    @functools.cached_property
    def special_ranges(self) -> list[tuple[int, int]]:
        ranges, offset = [], 0
        for piece in self.pieces:
            if type(piece) is Special:
                ranges.append((offset, offset + len(piece)))
            offset += len(piece)
        return ranges


class _Template(NamedTuple):
    """The template tokens and fixed texts of one model version and one set of spellings."""

    bos: Special
    system: Special
    user: Special
    assistant: Special
    think_start: Special
    think_end: Special
    eos: Special
    reminder: Special
    image: Special
    dsml: Special
    calls: str  # tag name of the tool-calls block
    invoke: str
    parameter: str
    tools_head: tuple[str, ...]
    calls_open: tuple[str, ...]  # the pieces around tool calls, spelled once
    calls_close: tuple[str, ...]
    invoke_close: tuple[str, ...]


@functools.cache
def _template(version: ModelVersion, tokens: SpecialTokens) -> _Template:
    dsml = Special(tokens.dsml)
    return _Template(
        *(
            Special(spelling)
            for spelling in (
                tokens.bos,
                tokens.system,
                tokens.user,
                tokens.assistant,
                tokens.think_start,
                tokens.think_end,
                tokens.eos,
                tokens.latest_reminder,
                tokens.image,
            )
        ),
        dsml=dsml,
        calls=version.calls_block,
        invoke=version.invoke_tag,
        parameter=version.parameter_tag,
        tools_head=tuple(Special(text) if special else text for text, special in tools_head(version, tokens)),
        calls_open=("\n\n<", dsml, version.calls_block + ">\n"),
        calls_close=("\n</", dsml, version.calls_block + ">"),
        invoke_close=(dsml, version.invoke_tag + ">"),
    )


class _Renderer:
    """Renders one conversation for one model version; `history` selects the training rendering."""

    def __init__(self, conversation: Conversation, version: ModelVersion, tokens: SpecialTokens, history: bool):
        self.conv = conversation
        self.version = version
        self.v41 = version is ModelVersion.V41
        self.t = _template(version, tokens)
        self.history = history
        self.pieces: list[str] = []
        self.images: list[Image] = []
        self.spans: list[tuple[int, int]] = []  # piece ranges of assistant output
        self._user_text = False  # V4: whether the user messages merged so far have text

    def render(self) -> RenderedPrompt:
        conv, t, out = self.conv, self.t, self.pieces
        messages = _normalize(conv.messages, self.version)
        keep_from = self._first_kept_reasoning(messages)
        effort = effort_line(self.version, conv.reasoning_effort) if conv.thinking else ""
        head_extras = self._system_extras()
        if head_extras and not (messages and isinstance(messages[0], System)):
            messages.insert(0, System(""))
        out.append(t.bos)
        previous: Message | None = None
        for index, message in enumerate(messages):
            kind = type(message)
            if index == 0:
                if self.v41 and (effort or kind is System):
                    out.append(t.system)
                out.append(effort)
            if kind is User or kind is ToolResult:
                self._user(message, previous)  # type: ignore[arg-type]
            elif kind is Assistant:
                self._assistant(message, keep_reasoning=index >= keep_from)  # type: ignore[arg-type]
            elif kind is System:
                if index and self.v41:
                    out.append(t.system)
                self._content(message.content)
                if index == 0:
                    out += head_extras
            else:
                out += (t.reminder, message.content)
            previous = message
        if not self.history and not (isinstance(previous, Assistant) and previous.prefix):
            out += (t.assistant, t.think_start if conv.thinking else t.think_end)
            if conv.tool_choice == "required" and conv.tools:
                out += ("\n\n<", t.dsml, t.calls + ">\n")
        return RenderedPrompt(out, self.images)

    def _user(self, message: User | ToolResult, previous: Message | None) -> None:
        """A user message or tool result; consecutive ones share one user turn, joined by a blank line.
        V4 first merges consecutive user messages, joining only the non-empty ones."""
        out = self.pieces
        kind, before = type(message), type(previous)
        joined = before is User or before is ToolResult
        merged = joined and not self.v41 and before is User and kind is User
        content = message.content
        if kind is ToolResult:
            has_text = True
        else:
            has_text = bool(content) if type(content) is str else len(content) > 1 or any(content)
        if not joined:
            out.append(self.t.user)
        elif not merged or (self._user_text and has_text):
            out.append("\n\n")
        self._user_text = (merged and self._user_text) or has_text
        if kind is ToolResult:
            out.append("<tool_result>")
            self._content(content)
            out.append("</tool_result>")
        else:
            self._content(content)

    def _first_kept_reasoning(self, messages: list[Message]) -> int:
        """Index from which assistant turns keep their reasoning (len(messages): none do)."""
        if not self.conv.thinking:
            return len(messages)
        if self.conv.uses_tools:
            return 0
        if not self.history:
            return len(messages)
        # The official rule: turns after the last user message (a later system message counts as one).
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if isinstance(message, _USER_TURN) or (isinstance(message, System) and index > 0):
                return index + 1
        return 0

    def _system_extras(self) -> list[str]:
        """The tools and response-format sections appended to the first system message."""
        conv, extras = self.conv, []
        v4 = not self.v41
        if conv.uses_tools:
            extras += self.t.tools_head
            extras.append("\n".join([_schema_line(tool, v4) for tool in conv.tools]))
            extras.append(TOOLS_TAIL)
        fmt = conv.response_format
        if fmt is not None and fmt.type != "regex":
            if fmt.type == "json_object" and v4:
                extras.append(V4_JSON_OBJECT_FORMAT)
            else:
                schema = {"type": "json_object"} if fmt.type == "json_object" else fmt.schema
                extras.append(SCHEMA_FORMAT_HEAD + pyjson.dumps(schema, v4=v4))
        return extras

    def _content(self, content: Content) -> None:
        out = self.pieces
        if type(content) is str:
            out.append(content)  # type: ignore[arg-type]
            return
        for position, part in enumerate(content):
            if position:
                out.append("\n\n")
            if isinstance(part, str):
                out.append(part)
            elif self.v41:
                self.images.append(part)
                out.append(self.t.image)
            else:
                out.append(UNSUPPORTED_IMAGE)

    def _assistant(self, message: Assistant, keep_reasoning: bool) -> None:
        out, t = self.pieces, self.t
        out.append(t.assistant)
        if self.conv.thinking and (keep_reasoning or message.prefix):
            out.append(t.think_start)
            start = len(out)
            out.append(message.reasoning or "")
            if message.prefix and not message.content:
                return
            out.append(t.think_end)
        else:
            out.append(t.think_end)
            start = len(out)
        out.append(message.content)
        if message.tool_calls:
            self._tool_calls(message.tool_calls)
        if not message.prefix:
            out.append(t.eos)
            self.spans.append((start, len(out)))

    def _tool_calls(self, calls: list[ToolCall]) -> None:
        out, t = self.pieces, self.t
        dsml, invoke, parameter, close, v4 = t.dsml, t.invoke, t.parameter, t.invoke_close, not self.v41
        out += t.calls_open
        opening = "<"
        for call in calls:
            out += (opening, dsml, f'{invoke} name="{call.name}">')
            out += _parameters(call.arguments, dsml, parameter, v4)
            out += close
            opening = "\n<"
        out += t.calls_close


def _normalize(messages: list[Message], version: ModelVersion) -> list[Message]:
    """V4 gathers the system messages at the top; tool results follow the order of the calls."""
    if version is ModelVersion.V4 and any(isinstance(m, System) for m in messages):
        head = "\n\n".join(text for m in messages if isinstance(m, System) and (text := _v4_text(m.content)))
        messages = [System(head), *(m for m in messages if not isinstance(m, System))]
    else:
        messages = list(messages)
    _order_tool_results(messages)
    return messages


def _v4_text(content: Content) -> str:
    """System content as V4 text: V4 has no vision, an image is a note."""
    if isinstance(content, str):
        return content
    return "\n\n".join(part if isinstance(part, str) else UNSUPPORTED_IMAGE for part in content)


def _order_tool_results(messages: list[Message]) -> None:
    """Reorder each run of tool results to the order of the preceding assistant's tool calls."""
    calls: list[ToolCall] = []  # of the last assistant turn with tool calls
    run: list[int] = []  # indices of the current run of tool results (user messages interleaved)
    for index, message in enumerate([*messages, None]):
        kind = type(message)
        if kind is ToolResult:
            run.append(index)
        elif kind is not User:
            if len(run) > 1 and calls:
                order = {call.id: position for position, call in enumerate(calls)}
                results = sorted((messages[i] for i in run), key=lambda m: order.get(m.tool_call_id, 0))  # type: ignore[union-attr]
                for slot, result in zip(run, results, strict=True):
                    messages[slot] = result
            run = []
            if kind is Assistant and message.tool_calls:  # type: ignore[union-attr]
                calls = message.tool_calls  # type: ignore[union-attr]


# Agents resend their tools and their earlier tool calls with every turn: the rendered schema lines and
# call parameters are memoised (bounded), keyed by exactly what determines them.
_SCHEMA_LINES: dict[tuple[bytes, bool], str] = {}
_MEMO_LIMIT = 4096


def _schema_line(tool: Tool, v4: bool) -> str:
    key = (_encode_json((tool.name, tool.description, tool.parameters)), v4)
    line = _SCHEMA_LINES.get(key)
    if line is None:
        if len(_SCHEMA_LINES) >= _MEMO_LIMIT:
            _SCHEMA_LINES.clear()
        value = {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters}
        line = _SCHEMA_LINES[key] = pyjson.dumps(value, v4=v4)
    return line


@functools.lru_cache(maxsize=_MEMO_LIMIT)
def _parameters(arguments: str, dsml: Special, parameter: str, v4: bool) -> tuple[str, ...]:
    """The DSML parameter lines of a call, from its arguments text up to the closing `</`."""
    try:
        values = _decode_json(arguments)
    except msgspec.DecodeError:
        values = None
    if not isinstance(values, dict):
        values = {"arguments": arguments}  # text that is not a JSON object renders as one string
    # An empty call: V4.1 keeps an empty parameter line, V4 does not.
    pieces: list[str] = ["\n" if values or v4 else "\n\n"]
    opening, close = "<", parameter + ">"
    for key, value in values.items():
        if type(value) is str:
            text = f'{parameter} name="{key}" string="true">{value}</'
        else:
            text = f'{parameter} name="{key}" string="false">{pyjson.dumps(value, v4=v4)}</'
        pieces += (opening, dsml, text, dsml, close)
        opening = "\n<"
    pieces.append("\n</" if values else "</")
    return tuple(pieces)


def _prompt(
    renderer: _Renderer, tokenizer: Tokenizer | None, spans: bool, token_limit: int | None = None
) -> RenderedPrompt:
    prompt = renderer.render()
    offsets: list[int] | None = None
    if tokenizer is not None:
        prompt.token_ids, offsets = tokenizer.encode_pieces(prompt.pieces, token_limit)
    if spans:
        if offsets is None:
            offsets = [0]
            for piece in prompt.pieces:
                offsets.append(offsets[-1] + len(piece))
        prompt.assistant_spans = [(offsets[start], offsets[end]) for start, end in renderer.spans]
    return prompt


def _tokens(tokenizer: Tokenizer | None, tokens: SpecialTokens | None) -> SpecialTokens:
    return tokens or (tokenizer.tokens if tokenizer is not None else DEFAULT_TOKENS)


def render(
    conversation: Conversation,
    model: ModelVersion | str = ModelVersion.V41,
    tokenizer: Tokenizer | None = None,
    *,
    tokens: SpecialTokens | None = None,
    token_limit: int | None = None,
) -> RenderedPrompt:
    """The request prompt: the conversation followed by the generation header of the next turn.

    `model` is a `ModelVersion` or its name (`DeepSeek-V4.1-Flash`, `DeepSeek-V4-Pro`). With a tokenizer
    the result carries `token_ids`; with `token_limit` too, a prompt of more tokens raises `PromptTooLongError` as soon
    as encoding finds it over (a server refuses an over-long prompt without encoding all of it). `tokens`
    overrides spellings (default: the tokenizer's, else official).
    """
    renderer = _Renderer(conversation, ModelVersion(model), _tokens(tokenizer, tokens), history=False)
    return _prompt(renderer, tokenizer, spans=False, token_limit=token_limit)


def render_history(
    conversation: Conversation,
    model: ModelVersion | str = ModelVersion.V41,
    tokenizer: Tokenizer | None = None,
    *,
    tokens: SpecialTokens | None = None,
) -> RenderedPrompt:
    """A finished conversation rendered for training, with `assistant_spans` marking what to learn.

    Differs from `render` as the official encoder does: assistant turns after the last user message keep
    their reasoning, and no generation header follows the last message.
    """
    renderer = _Renderer(conversation, ModelVersion(model), _tokens(tokenizer, tokens), history=True)
    return _prompt(renderer, tokenizer, spans=True)
