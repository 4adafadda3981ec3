"""The output constraint of a tool-calling request as a grammar a constrained decoder enforces.

The grammar is a *structural tag* in xgrammar's JSON format (data only: the recipe imports no grammar engine): the
DSML tool-calls block, each `invoke` naming a declared function, its `parameter` lines schema-valid arguments
(`string="true"` values raw, the others JSON valid under the property's schema; xgrammar's `deepseek_xml` /
`deepseek_v4_1_xml` styles spell exactly the markup the prompt renders, see templates.py).

- `tool_call_required` (or a named function): one or more calls, the block's end, then the stop token. The prompt of
  a required OpenAI tool choice already opened the block (it ends with `</think>\\n\\n<｜DSML｜ calls>\\n`); the
  prompt of Anthropic's `any` is auto's, so there the answer opens it (`\\n\\n<｜DSML｜ calls>\\n`, as the template
  renders a call).
- `tool_call` (tool choice auto): free text, and once the model opens a calls block it holds valid calls; nothing
  follows the block's end (the output parser discards it anyway).
"""

from __future__ import annotations

from typing import Any

import msgspec

from recipe.options import OutputConstraint
from recipe.tokens import DEFAULT_TOKENS, ModelVersion, SpecialTokens

TOOL_KINDS = ("tool_call", "tool_call_required")
MAX_WHITESPACE = 16  # whitespace characters between two JSON tokens of an argument (pretty-printed JSON fits)


class _Function(msgspec.Struct):
    name: str
    parameters: Any = None


class _Declared(msgspec.Struct):
    function: _Function


def tool_calls_tag(
    constraint: OutputConstraint, version: ModelVersion, *, opened: bool, tokens: SpecialTokens = DEFAULT_TOKENS
) -> str:
    """The structural tag (JSON text) of a `tool_call` / `tool_call_required` constraint; `opened`: the prompt
    already opened the calls block (`ParsingOptions.starts_in_tool_calls`)."""
    if constraint.kind not in TOOL_KINDS:
        raise ValueError(f"not a tool-call constraint: {constraint.kind}")
    declared = msgspec.json.decode(constraint.schema, type=list[_Declared])
    dsml, calls = tokens.dsml, version.calls_block
    invokes = {
        "type": "tags_with_separator",
        "tags": [_invoke(d.function, version, dsml) for d in declared],
        "separator": "",
        "at_least_one": True,
    }
    end = f"</{dsml}{calls}>"
    if constraint.kind == "tool_call_required":
        elements = [invokes, {"type": "const_string", "value": end}]
        if not opened:
            elements.insert(0, {"type": "const_string", "value": f"\n\n<{dsml}{calls}>\n"})
        answer: dict[str, Any] = {"type": "sequence", "elements": elements}
    else:
        block = {"type": "tag", "begin": f"<{dsml}{calls}>\n", "content": invokes, "end": end}
        answer = {"type": "triggered_tags", "triggers": [f"<{dsml}{calls}>"], "tags": [block], "stop_after_first": True}
    return msgspec.json.encode({"type": "structural_tag", "format": answer}).decode()


def _invoke(function: _Function, version: ModelVersion, dsml: str) -> dict[str, Any]:
    """One call of `function`: its invoke tag around its arguments as DSML parameter lines."""
    style = "deepseek_xml" if version is ModelVersion.V4 else "deepseek_v4_1_xml"
    return {
        "type": "tag",
        "begin": f'<{dsml}{version.invoke_tag} name="{function.name}">\n',
        "content": {
            "type": "json_schema",
            "json_schema": function.parameters or {},
            "style": style,
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": f"</{dsml}{version.invoke_tag}>\n",
    }
