"""recipe: the DeepSeek V4 / V4.1 conversation codec (no torch, no grpc).

API requests (OpenAI Chat Completions and Responses, Anthropic Messages) → `convert` → a neutral
`Conversation` → `render` → prompt text and token ids; model output → `StreamProcessor` → each API's
stream events (`Event.sse()`) and complete response. See docs/recipe.md.
"""

from recipe.conversation import (
    Assistant,
    Conversation,
    Image,
    LatestReminder,
    Message,
    ResponseFormat,
    System,
    Tool,
    ToolCall,
    ToolResult,
    User,
)
from recipe.convert import convert
from recipe.errors import APIS, Api, RecipeError
from recipe.options import ConversionOptions, ConvertedRequest, OutputConstraint, ParsingOptions, Sampling
from recipe.parser import Out, Parser
from recipe.render import RenderedPrompt, render, render_history
from recipe.response.events import DONE, Event, Finish, Usage
from recipe.stream import MultiChoiceProcessor, StreamProcessor
from recipe.tokenizer import PromptTooLongError, Tokenizer, load_tokenizer
from recipe.tokens import ModelVersion, SpecialTokens

__all__ = [
    "APIS",
    "DONE",
    "Api",
    "Assistant",
    "Conversation",
    "ConversionOptions",
    "ConvertedRequest",
    "Event",
    "Finish",
    "Image",
    "LatestReminder",
    "Message",
    "ModelVersion",
    "MultiChoiceProcessor",
    "Out",
    "OutputConstraint",
    "Parser",
    "ParsingOptions",
    "PromptTooLongError",
    "RecipeError",
    "RenderedPrompt",
    "ResponseFormat",
    "Sampling",
    "SpecialTokens",
    "StreamProcessor",
    "System",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolResult",
    "Usage",
    "User",
    "convert",
    "load_tokenizer",
    "render",
    "render_history",
]
