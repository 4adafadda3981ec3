"""Model output text → an `Assistant` message, through recipe's output parser (as the gateway reads it)."""

from __future__ import annotations

from recipe import Assistant, ParsingOptions, ToolCall
from recipe.parser import Out, Parser


def parse_assistant(text: str, *, reasoning: bool, tools: bool, json_mode: bool = False) -> Assistant:
    """Parse one assistant turn's text (without its EOS).

    reasoning: the text starts inside `<think>` (the prompt ended with it); tools: DSML calls are recognised;
    json_mode: the answer is read as JSON output. Tool call ids are numbered `call_0`, `call_1`, … in order.
    """
    options = ParsingOptions(
        parse_tool_calls=tools,
        parse_json_output=json_mode,
        thinking_stage="reasoning_start" if reasoning else None,
    )
    parser = Parser(options)
    parts: dict[Out, list[str]] = {Out.REASONING: [], Out.CONTENT: []}
    calls: list[ToolCall] = []
    name, args = "", []
    for kind, piece in parser.feed(text) + parser.finish():
        if kind in parts:
            parts[kind].append(piece)
        elif kind is Out.TOOL_START:
            name, args = piece, []
        elif kind is Out.ARGS:
            args.append(piece)
        elif kind is Out.TOOL_END:
            calls.append(ToolCall(id=f"call_{len(calls)}", name=name, arguments="".join(args)))
    thought = "".join(parts[Out.REASONING])
    return Assistant(
        content="".join(parts[Out.CONTENT]),
        reasoning=thought if reasoning else None,
        tool_calls=calls,
    )
