"""The special tokens of the DeepSeek V4 / V4.1 chat format and the model versions that use them.

Every spelling is configurable through `SpecialTokens` (the image token differs between the official
encoder, `<｜deepseek_image｜>`, and deepseek-recipe, `<｜image｜>`); the defaults are the official ones.
"""

from __future__ import annotations

import enum

import msgspec

OFFICIAL_IMAGE_TOKEN = "<｜deepseek_image｜>"
RECIPE_IMAGE_TOKEN = "<｜image｜>"

# Ids in the released vocabulary that the V4.1 names are patched onto (the V4 tokenizer.json ships placeholders).
SYSTEM_TOKEN_ID = 128799
IMAGE_TOKEN_ID = 129264


class SpecialTokens(msgspec.Struct, frozen=True):
    """Spellings of the template tokens. `dsml` has no angle brackets: the template adds `<` and `</`."""

    bos: str = "<｜begin▁of▁sentence｜>"
    eos: str = "<｜end▁of▁sentence｜>"
    think_start: str = "<think>"
    think_end: str = "</think>"
    system: str = "<｜System｜>"
    user: str = "<｜User｜>"
    assistant: str = "<｜Assistant｜>"
    latest_reminder: str = "<｜latest_reminder｜>"
    dsml: str = "｜DSML｜"
    image: str = OFFICIAL_IMAGE_TOKEN


DEFAULT_TOKENS = SpecialTokens()


class ModelVersion(enum.Enum):
    """The prompt encoding a model name selects."""

    V4 = "DeepSeek-V4-Pro"
    V41 = "DeepSeek-V4.1-Flash"

    @property
    def calls_block(self) -> str:
        """Tag name of the DSML tool-calls block (V4.1 tag names carry a leading space)."""
        return "tool_calls" if self is ModelVersion.V4 else " calls"

    @property
    def invoke_tag(self) -> str:
        return "invoke" if self is ModelVersion.V4 else " invoke"

    @property
    def parameter_tag(self) -> str:
        return "parameter" if self is ModelVersion.V4 else " parameter"
