"""Conversation → DeepSeek V4 / V4.1 prompt, as text and (with a tokenizer) token ids.

The prompt is built as pieces, each plain text or one template token. Token ids encode every run of
plain text as plain BPE and every template token as its added-vocabulary id, so a user who types
`<｜User｜>` gets the ids of those characters, never the control token.

Request prompts follow deepseek-recipe 0.2.0: in thinking mode the reasoning of earlier assistant turns
is dropped unless the request declares tools. `render_history` renders a finished conversation for
training, as the official encoder does: reasoning is kept for the turns after the last user message,
there is no generation header, and the spans the model must learn to produce are returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from recipe import pyjson
from recipe.conversation import (
    Assistant,
    Content,
    Conversation,
    Image,
    LatestReminder,
    Message,
    System,
    Tool,
    ToolCall,
    ToolResult,
    User,
)
from recipe.templates import (
    SCHEMA_FORMAT_HEAD,
    TOOLS_TAIL,
    V4_JSON_OBJECT_FORMAT,
    effort_line,
    tools_head,
)
from recipe.tokens import DEFAULT_TOKENS, ModelVersion, SpecialTokens

if TYPE_CHECKING:
    from recipe.tokenizer import Tokenizer

UNSUPPORTED_IMAGE = "[Unsupported Image]"
_decode_json = msgspec.json.decode


class RenderedPrompt(msgspec.Struct):
    """A rendered prompt.

    text: the prompt.
    special_ranges: `(start, end)` code-point ranges of `text` that are template tokens.
    images: the images, in the order of their placeholders.
    token_ids: the prompt's token ids (only when rendered with a tokenizer).
    assistant_spans: `render_history` only: `(start, end)` ranges of `token_ids` (of `text` without a
        tokenizer) that the assistant produced: reasoning, `</think>`, answer, tool calls and EOS.
    """

    text: str
    special_ranges: list[tuple[int, int]]
    images: list[Image]
    token_ids: list[int] | None = None
    assistant_spans: list[tuple[int, int]] | None = None


class _Pieces:
    """The prompt under construction: texts, which of them are template tokens, and assistant spans."""

    __slots__ = ("images", "spans", "special", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.special: list[int] = []
        self.images: list[Image] = []
        self.spans: list[tuple[int, int]] = []

    def plain(self, text: str) -> None:
        if text:
            self.texts.append(text)

    def token(self, text: str) -> None:
        self.special.append(len(self.texts))
        self.texts.append(text)

    def extend(self, pieces: Sequence[tuple[str, bool]]) -> None:
        for text, special in pieces:
            if special:
                self.token(text)
            else:
                self.plain(text)


class _Renderer:
    """Renders one conversation for one model version; `history` selects the training rendering."""

    def __init__(self, conversation: Conversation, version: ModelVersion, tokens: SpecialTokens, history: bool):
        self.conv = conversation
        self.version = version
        self.tokens = tokens
        self.history = history
        self.out = _Pieces()
        self._user_text = False  # V4: whether the user messages merged so far have text

    def render(self) -> _Pieces:
        conv, tok, out = self.conv, self.tokens, self.out
        messages = _normalize(conv.messages, self.version)
        keep_from = self._first_kept_reasoning(messages)
        effort = effort_line(self.version, conv.reasoning_effort) if conv.thinking else ""
        head_extras = self._system_extras()
        if head_extras and not (messages and isinstance(messages[0], System)):
            messages.insert(0, System(""))
        out.token(tok.bos)
        previous: Message | None = None
        for index, message in enumerate(messages):
            if index == 0:
                if self.version is ModelVersion.V41 and (effort or isinstance(message, System)):
                    out.token(tok.system)
                out.plain(effort)
            if isinstance(message, System):
                if index > 0 and self.version is ModelVersion.V41:
                    out.token(tok.system)
                self._content(message.content)
                if index == 0:
                    out.extend(head_extras)
            elif isinstance(message, User | ToolResult):
                self._user(message, previous)
            elif isinstance(message, LatestReminder):
                out.token(tok.latest_reminder)
                out.plain(message.content)
            else:
                self._assistant(message, keep_reasoning=index >= keep_from)
            previous = message
        if not self.history and not (isinstance(previous, Assistant) and previous.prefix):
            self._generation_header()
        return out

    def _user(self, message: User | ToolResult, previous: Message | None) -> None:
        """A user message or tool result; consecutive ones share one user turn, joined by a blank line.
        V4 first merges consecutive user messages, joining only the non-empty ones."""
        out = self.out
        joined = isinstance(previous, User | ToolResult)
        merged = joined and self.version is ModelVersion.V4 and isinstance(previous, User) and isinstance(message, User)
        if not joined:
            out.token(self.tokens.user)
        mark = len(out.texts)
        if isinstance(message, ToolResult):
            out.plain("<tool_result>")
            self._content(message.content)
            out.plain("</tool_result>")
        else:
            self._content(message.content)
        has_text = len(out.texts) > mark
        if joined and (not merged or (self._user_text and has_text)):
            out.texts.insert(mark, "\n\n")
            out.special = [i + 1 if i >= mark else i for i in out.special]
        self._user_text = (merged and self._user_text) or has_text

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
            if isinstance(message, User | ToolResult) or (isinstance(message, System) and index > 0):
                return index + 1
        return 0

    def _system_extras(self) -> list[tuple[str, bool]]:
        """The tools and response-format sections appended to the first system message."""
        conv, extras = self.conv, []
        if conv.uses_tools:
            extras += tools_head(self.version, self.tokens)
            v4 = self.version is ModelVersion.V4
            extras.append(("\n".join(_schema_line(tool, v4) for tool in conv.tools), False))
            extras.append((TOOLS_TAIL, False))
        fmt = conv.response_format
        if fmt is not None and fmt.type != "regex":
            if fmt.type == "json_object" and self.version is ModelVersion.V4:
                extras.append((V4_JSON_OBJECT_FORMAT, False))
            else:
                schema = {"type": "json_object"} if fmt.type == "json_object" else fmt.schema
                extras.append((SCHEMA_FORMAT_HEAD + pyjson.dumps(schema, v4=self.version is ModelVersion.V4), False))
        return extras

    def _content(self, content: Content) -> None:
        if isinstance(content, str):
            self.out.plain(content)
            return
        for position, part in enumerate(content):
            if position:
                self.out.plain("\n\n")
            if isinstance(part, str):
                self.out.plain(part)
            elif self.version is ModelVersion.V41:
                self.out.images.append(part)
                self.out.token(self.tokens.image)
            else:
                self.out.plain(UNSUPPORTED_IMAGE)

    def _assistant(self, message: Assistant, keep_reasoning: bool) -> None:
        out, tok = self.out, self.tokens
        out.token(tok.assistant)
        if self.conv.thinking and (keep_reasoning or message.prefix):
            out.token(tok.think_start)
            start = len(out.texts)
            out.plain(message.reasoning or "")
            if message.prefix and not message.content:
                return
            out.token(tok.think_end)
        else:
            out.token(tok.think_end)
            start = len(out.texts)
        out.plain(message.content)
        if message.tool_calls:
            self._tool_calls(message.tool_calls)
        if not message.prefix:
            out.token(tok.eos)
            out.spans.append((start, len(out.texts)))

    def _tool_calls(self, calls: list[ToolCall]) -> None:
        out, dsml, version = self.out, self.tokens.dsml, self.version
        out.plain("\n\n<")
        out.token(dsml)
        out.plain(version.calls_block + ">\n")
        for position, call in enumerate(calls):
            if position:
                out.plain("\n")
            out.plain("<")
            out.token(dsml)
            out.plain(f'{version.invoke_tag} name="{call.name}">')
            arguments = _call_arguments(call)
            # An empty call: V4.1 keeps an empty parameter line, V4 does not.
            out.plain("\n" if arguments or version is ModelVersion.V4 else "\n\n")
            for number, (key, value) in enumerate(arguments.items()):
                if number:
                    out.plain("\n")
                out.plain("<")
                out.token(dsml)
                if isinstance(value, str):
                    out.plain(f'{version.parameter_tag} name="{key}" string="true">{value}</')
                else:
                    text = pyjson.dumps(value, v4=version is ModelVersion.V4)
                    out.plain(f'{version.parameter_tag} name="{key}" string="false">{text}</')
                out.token(dsml)
                out.plain(version.parameter_tag + ">")
            out.plain("\n</" if arguments else "</")
            out.token(dsml)
            out.plain(version.invoke_tag + ">")
        out.plain("\n</")
        out.token(dsml)
        out.plain(version.calls_block + ">")

    def _generation_header(self) -> None:
        out, tok, conv = self.out, self.tokens, self.conv
        out.token(tok.assistant)
        out.token(tok.think_start if conv.thinking else tok.think_end)
        if conv.tool_choice == "required" and conv.tools:
            out.plain("\n\n<")
            out.token(tok.dsml)
            out.plain(self.version.calls_block + ">\n")


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
    order: dict[str, int] = {}
    index = 0
    while index < len(messages):
        message = messages[index]
        if not isinstance(message, User | ToolResult):
            if isinstance(message, Assistant) and message.tool_calls:
                order = {call.id: position for position, call in enumerate(message.tool_calls)}
            index += 1
            continue
        start = index
        while index < len(messages) and isinstance(messages[index], User | ToolResult):
            index += 1
        slots = [i for i in range(start, index) if isinstance(messages[i], ToolResult)]
        if len(slots) > 1 and order:
            results = sorted((messages[i] for i in slots), key=lambda m: order.get(m.tool_call_id, 0))  # type: ignore[union-attr]
            for slot, result in zip(slots, results, strict=True):
                messages[slot] = result


def _schema_line(tool: Tool, v4: bool) -> str:
    line = {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters}
    return pyjson.dumps(line, v4=v4)


def _call_arguments(call: ToolCall) -> dict:
    """The call's arguments as an object; text that is not a JSON object renders as one string."""
    try:
        arguments = _decode_json(call.arguments)
    except msgspec.DecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        return {"arguments": call.arguments}
    if pyjson.has_long_integers(call.arguments.encode()):
        arguments = pyjson.narrow_integers(arguments)
    return arguments


def _finish(pieces: _Pieces, tokenizer: Tokenizer | None, spans: bool) -> RenderedPrompt:
    texts = pieces.texts
    special = set(pieces.special)
    offsets = [0]
    for text in texts:
        offsets.append(offsets[-1] + len(text))
    special_ranges = [(offsets[i], offsets[i + 1]) for i in pieces.special]
    prompt = RenderedPrompt("".join(texts), special_ranges, pieces.images)
    if tokenizer is not None:
        prompt.token_ids, token_offsets = tokenizer.encode_pieces(texts, special)
        offsets = token_offsets
    if spans:
        prompt.assistant_spans = [(offsets[start], offsets[end]) for start, end in pieces.spans]
    return prompt


def render(
    conversation: Conversation,
    model: ModelVersion | str = ModelVersion.V41,
    tokenizer: Tokenizer | None = None,
    *,
    tokens: SpecialTokens | None = None,
) -> RenderedPrompt:
    """The request prompt: the conversation followed by the generation header of the next turn.

    `model` is a `ModelVersion` or its name (`DeepSeek-V4.1-Flash`, `DeepSeek-V4-Pro`). With a tokenizer
    the result carries `token_ids`. `tokens` overrides spellings (default: the tokenizer's, else official).
    """
    version = ModelVersion(model)
    tokens = tokens or (tokenizer.tokens if tokenizer is not None else DEFAULT_TOKENS)
    return _finish(_Renderer(conversation, version, tokens, history=False).render(), tokenizer, spans=False)


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
    version = ModelVersion(model)
    tokens = tokens or (tokenizer.tokens if tokenizer is not None else DEFAULT_TOKENS)
    return _finish(_Renderer(conversation, version, tokens, history=True).render(), tokenizer, spans=True)
