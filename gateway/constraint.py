"""A request's output constraint as decode enforces it (`decode.v1.OutputConstraint`), from the recipe's.

- `json` (a schema, strict or not, or any object) and `regex`: the grammar of the answer;
- `tool_call_required` / `tool_call`: the DSML tool-call block as a structural tag (recipe.grammar), every call's
  arguments valid under its tool's schema;
- an answer that may not hold a tool call (no tools declared, tool_choice none, or a response format) bans the DSML
  marker token, so no tool markup reaches the content.

The reasoning is free: in thinking mode the constraint starts at `</think>`. A prefix continuation's partial answer is
the grammar's start (decode refuses a prefix the grammar does not allow). Decode compiles the constraint and refuses
one it cannot compile with INVALID_ARGUMENT, which the gateway answers with a 400 in the API's shape.
"""

from __future__ import annotations

from proto.decode.v1 import decode_pb2
from recipe import Assistant, ConvertedRequest, Tokenizer
from recipe.grammar import TOOL_KINDS, tool_calls_tag

REASONING = ("reasoning_start", "reasoning_continuation")


def output_constraint(request: ConvertedRequest, tokenizer: Tokenizer) -> decode_pb2.OutputConstraint:
    c, tokens = request.output_constraint, tokenizer.tokens
    out = decode_pb2.OutputConstraint()
    if c is not None and c.kind == "json":
        if c.schema:
            out.json_schema, out.strict = c.schema, c.strict
        else:
            out.json_object = True
    elif c is not None and c.kind == "regex":
        out.regex = c.schema
    elif c is not None:
        opened = request.parsing.starts_in_tool_calls
        out.structural_tag = tool_calls_tag(c, request.version, opened=opened, tokens=tokens)
    if c is None or c.kind not in TOOL_KINDS:
        out.banned_token_ids.append(tokenizer.special_id(tokens.dsml))
    stage = request.parsing.thinking_stage
    if stage in REASONING:
        out.reasoning_end_token_id = tokenizer.special_id(tokens.think_end)
    messages = request.conversation.messages
    last = messages[-1] if messages else None
    if isinstance(last, Assistant) and last.prefix and stage not in REASONING:
        out.answer_prefix = last.content
    return out
