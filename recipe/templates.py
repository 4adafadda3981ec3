"""The fixed texts of the prompt: effort lines, the tools section, the response-format section.

Texts that mention template tokens (`<｜DSML｜ calls>`, `<think>`) keep those tokens special: a template
is returned as pieces `(text, is_special)` so the token-id encoder can tell them from plain text.
"""

from __future__ import annotations

import functools
import re

from recipe.tokens import ModelVersion, SpecialTokens

Piece = tuple[str, bool]

V41_EFFORT_LEVELS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
V41_EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose"
    " the problem into its most fundamental components, trace every causal chain to its root, and resolve the"
    " underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain"
    " that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

TOOLS_HEAD = (
    "\n\n## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<{dsml}{calls}>" block like the following:\n'
    "\n"
    "<{dsml}{calls}>\n"
    '<{dsml}{invoke} name="$TOOL_NAME">\n'
    '<{dsml}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{parameter}>\n'
    "...\n"
    "</{dsml}{invoke}>\n"
    '<{dsml}{invoke} name="$TOOL_NAME2">\n'
    "...\n"
    "</{dsml}{invoke}>\n"
    "</{dsml}{calls}>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning "
    "inside {think_start}...{think_end} BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after {think_end} with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

SCHEMA_FORMAT_HEAD = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
V4_JSON_OBJECT_FORMAT = (
    "\n\nYou are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY."
)

_FIELD = re.compile(r"\{(\w+)\}")
_SPECIAL_FIELDS = {"dsml", "think_start", "think_end"}


def effort_line(version: ModelVersion, effort: str | int | None) -> str:
    """The reasoning-effort text that opens a thinking-mode prompt."""
    if version is ModelVersion.V41:
        level = V41_EFFORT_LEVELS[effort or "high"] if not isinstance(effort, int) else effort
        return V41_EFFORT_LINE.format(level)
    # V4 knows three texts; an integer effort picks the nearest (<= 50 low, 100 max, else high).
    if isinstance(effort, int):
        effort = "low" if effort <= 50 else "max" if effort >= 100 else "high"
    return {"low": "", "max": V4_EFFORT_MAX}.get(effort or "high", V4_EFFORT_HIGH)


@functools.cache
def tools_head(version: ModelVersion, tokens: SpecialTokens) -> tuple[Piece, ...]:
    """The tools section up to the schema lines, as pieces."""
    values = {
        "dsml": tokens.dsml,
        "think_start": tokens.think_start,
        "think_end": tokens.think_end,
        "calls": version.calls_block,
        "invoke": version.invoke_tag,
        "parameter": version.parameter_tag,
    }
    pieces: list[Piece] = []
    last = 0
    for field in _FIELD.finditer(TOOLS_HEAD):
        name = field.group(1)
        text = TOOLS_HEAD[last : field.start()]
        if name in _SPECIAL_FIELDS:
            pieces += [(text, False), (values[name], True)]
        else:
            pieces.append((text + values[name], False))
        last = field.end()
    pieces.append((TOOLS_HEAD[last:], False))
    # Merge neighbouring plain pieces: fewer, longer plain runs.
    merged: list[Piece] = []
    for text, special in pieces:
        if merged and not special and not merged[-1][1]:
            merged[-1] = (merged[-1][0] + text, False)
        elif text:
            merged.append((text, special))
    return tuple(merged)
