"""What a converted request carries besides the Conversation: sampling, parsing and backend settings."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from recipe.conversation import Conversation
from recipe.errors import Api, RecipeError
from recipe.tokens import ModelVersion

ThinkingStage = Literal["reasoning_start", "reasoning_continuation", "content_continuation"]

# Default output budgets of deepseek-recipe when the request sets none.
DEFAULT_MAX_TOKENS = 8192
DEFAULT_THINKING_MAX_TOKENS = 65536
DEFAULT_THINKING_MAX_EFFORT_MAX_TOKENS = 131072


class ConversionOptions(msgspec.Struct, frozen=True, gc=False):
    """How requests are converted.

    default_thinking: thinking mode of requests that do not say.
    reasoning_content: history tool-call turns without reasoning in thinking mode: "fill_empty" or "reject".
    responses_web_search / messages_web_search: "drop" or "reject" web-search tools.
    responses_chain: Responses `previous_response_id`: "reject" (the codec keeps no responses), or "resolved" (the
        caller has spliced the previous response's items into `input`; the id is only echoed).
    thinking_max_tokens / non_thinking_max_tokens: the largest output budget a request may ask for.
    versions: the encodings whose official names requests may use (default both; a server that serves one
        lists only that one).
    model_aliases: extra model names and the encoding each selects.
    max_n: the largest `n` (Chat Completions choices) accepted.
    """

    default_thinking: bool = True
    reasoning_content: Literal["fill_empty", "reject"] = "fill_empty"
    responses_web_search: Literal["drop", "reject"] = "drop"
    responses_chain: Literal["reject", "resolved"] = "reject"
    messages_web_search: Literal["drop", "reject"] = "reject"
    thinking_max_tokens: int = 393216
    non_thinking_max_tokens: int = 393216
    versions: tuple[ModelVersion, ...] = tuple(ModelVersion)
    model_aliases: dict[str, ModelVersion] = msgspec.field(default_factory=dict)
    max_n: int = 16

    def model_version(self, model: str) -> ModelVersion:
        """The encoding `model` selects; a name outside `versions` and `model_aliases` is a 400 listing them."""
        version = self.model_aliases.get(model)
        if version is not None:
            return version
        for version in self.versions:
            if version.value == model:
                return version
        names = ", ".join([v.value for v in self.versions] + sorted(self.model_aliases))
        raise RecipeError(f"The supported API model names are {names}, but you passed {model}.", param="model")


class Sampling(msgspec.Struct, gc=False):
    """Sampling settings for the backend. `max_tokens` is the requested budget (None: use the default)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0


class OutputConstraint(msgspec.Struct, frozen=True, gc=False):
    """A constraint the backend may enforce by constrained decoding.

    kind: "json" (schema: compact JSON Schema, or "" for any JSON object), "regex" (schema: the pattern),
        "tool_call" / "tool_call_required" (schema: JSON array of the declared function tools).
    strict: "json" with a schema: its objects admit no property the schema does not name (a strict tool's
        parameters are already in that form).
    """

    kind: Literal["json", "regex", "tool_call", "tool_call_required"]
    schema: str = ""
    strict: bool = False


class ParsingOptions(msgspec.Struct, frozen=True, gc=False):
    """How to read the model output.

    parse_tool_calls: recognise DSML tool calls (only when the request declared tools).
    starts_in_tool_calls: the prompt already opened the tool-calls block (required tool choice).
    parse_json_output: JSON mode: keep the JSON and blank the text around it.
    thinking_stage: where thinking-mode output starts (None: thinking off).
    stop_sequences: stop strings, matched in the answer only.
    """

    parse_tool_calls: bool = False
    starts_in_tool_calls: bool = False
    parse_json_output: bool = False
    thinking_stage: ThinkingStage | None = None
    stop_sequences: tuple[str, ...] = ()


class ConvertedRequest(msgspec.Struct, gc=False):
    """A request converted for the DeepSeek model.

    api / model: the API and the requested model name (echoed in responses).
    version: the prompt encoding the model name selects.
    stream / include_usage: the client wants SSE (and, for Chat Completions, usage in the stream).
    stop_token_ids: token ids the backend must stop on (EOS).
    echo: Responses only: the request settings the response object reports.
    namespaces: Responses only: prompt tool name → (namespace, name) of namespaced functions.
    custom_tools: Responses only: names of custom tools (their calls are reported as custom tool calls).
    """

    api: Api
    model: str
    version: ModelVersion
    conversation: Conversation
    sampling: Sampling
    parsing: ParsingOptions
    output_constraint: OutputConstraint | None = None
    stream: bool = False
    include_usage: bool = False
    stop_token_ids: tuple[int, ...] = (1,)
    echo: dict[str, Any] | None = None
    namespaces: dict[str, tuple[str, str]] = msgspec.field(default_factory=dict)
    custom_tools: frozenset[str] = frozenset()

    def prompt_limit(self, context_limit: int) -> int:
        """The most prompt tokens that leave room for the requested output budget (all of the context when none is
        requested): `render(..., token_limit=...)` stops there."""
        return context_limit - (self.sampling.max_tokens or 0)

    def context_error(self, prompt_tokens: int, context_limit: int, *, at_least: bool = False) -> RecipeError:
        """The error of a prompt of `prompt_tokens` tokens (`at_least`: counting stopped there) that leaves no room
        for the requested budget."""
        requested = self.sampling.max_tokens
        some = "at least " if at_least else ""
        head = f"This model's maximum context length is {context_limit} tokens. However, "
        if requested is None:
            return RecipeError(f"{head}your messages resulted in {some}{prompt_tokens} tokens.", param="messages")
        return RecipeError(
            f"{head}you requested {some}{prompt_tokens + requested} tokens ({some}{prompt_tokens} in the messages, "
            f"{requested} in the completion).",
            param="max_tokens",
        )

    def resolve_max_tokens(self, prompt_tokens: int, context_limit: int) -> int:
        """The output budget to send to the backend for a prompt of `prompt_tokens` tokens.

        A requested budget is kept; otherwise 8192 (non-thinking), 131072 (thinking, max effort) or 65536.
        The result is lowered to the context left and is at least 1. A prompt that leaves no room for the
        requested budget (or, with none requested, no room at all) is an error.
        """
        if prompt_tokens > self.prompt_limit(context_limit):
            raise self.context_error(prompt_tokens, context_limit)
        requested = self.sampling.max_tokens
        conv = self.conversation
        if requested is None:
            if not conv.thinking:
                requested = DEFAULT_MAX_TOKENS
            elif conv.reasoning_effort == "max" or conv.reasoning_effort == 100:
                requested = DEFAULT_THINKING_MAX_EFFORT_MAX_TOKENS
            else:
                requested = DEFAULT_THINKING_MAX_TOKENS
        return max(1, min(requested, context_limit - prompt_tokens))
