"""Command line: batch prompt rendering and output parsing over JSON lines.

    python -m recipe render --api API [--model M] [--tokens]  < requests.jsonl
        one line per request: {"prompt": ..., "token_ids": [...]} or {"error": {"status", "message", "param"}}
    python -m recipe parse --api API --request REQ.json [--events]  < outputs.jsonl
        input lines {"chunks": ["..", ...], "finish": "stop"} (or {"token_ids": [...]}); one line per input:
        the complete response, or with --events the list of stream events ({"event", "data"})

A bad line is reported on its own output line and never stops the batch; a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from recipe.convert import convert
from recipe.errors import APIS, RecipeError
from recipe.options import ConvertedRequest
from recipe.render import render
from recipe.request.common import field_of
from recipe.stream import StreamProcessor
from recipe.tokenizer import Tokenizer, load_tokenizer

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class OutputLine(msgspec.Struct, omit_defaults=True):
    """One line of `parse` input: text chunks or token ids, and the backend's finish reason."""

    chunks: list[str] | None = None
    token_ids: list[int] | None = None
    finish: str | None = "stop"


def _error(error: RecipeError) -> dict[str, Any]:
    return {"error": {"status": error.status, "message": error.message, "param": error.param}}


def render_lines(lines: Iterable[bytes], api: str, model: str | None, tokenizer: Tokenizer | None) -> Iterable[bytes]:
    """`render`: one output line per request line."""
    for line in lines:
        if not line.strip():
            continue
        try:
            body = _decode(line)
            if not isinstance(body, dict):
                raise RecipeError("each line must hold a JSON object (a request body)")
            if model is not None:
                body["model"] = model
            converted = convert(api, body)  # type: ignore[arg-type]
            prompt = render(converted.conversation, converted.version, tokenizer)
            out: dict[str, Any] = {"prompt": prompt.text}
            if prompt.token_ids is not None:
                out["token_ids"] = prompt.token_ids
        except msgspec.DecodeError as error:
            out = _error(RecipeError(f"Invalid JSON line: {error}"))
        except RecipeError as error:
            out = _error(error)
        yield _encode(out)


def parse_lines(
    lines: Iterable[bytes], converted: ConvertedRequest, events: bool, tokenizer: Callable[[], Tokenizer]
) -> Iterable[bytes]:
    """`parse`: one complete response (or event list) per output line; `tokenizer` is loaded on first use."""
    for line in lines:
        if not line.strip():
            continue
        try:
            item = _decode(line, type=OutputLine)
            if item.finish not in ("stop", "length", "content_filter", None):
                raise RecipeError(f"finish must be stop, length, content_filter or null, not {item.finish!r}")
            tokens = tokenizer() if item.token_ids is not None else None
            processor = StreamProcessor(converted, tokenizer=tokens, stream=events)
            produced = processor.start()
            for chunk in item.chunks or ():
                produced += processor.push_text(chunk)
            if item.token_ids is not None:
                produced += processor.push_tokens(item.token_ids)
            produced += processor.finish(item.finish)  # type: ignore[arg-type]
            out: Any = [{"event": e.name, "data": e.json()} for e in produced] if events else processor.response()
        except msgspec.DecodeError as error:
            out = _error(RecipeError(f"Invalid line: {error}", param=field_of(str(error))))
        except RecipeError as error:
            out = _error(error)
        yield _encode(out)


def _write(outputs: Iterable[bytes], sink: BinaryIO, progress: bool) -> tuple[int, int]:
    """Write the output lines; on a terminal, count them on stderr as they go."""
    count = errors = 0
    for out in outputs:
        sink.write(out + b"\n")
        count += 1
        errors += out.startswith(b'{"error":')
        if progress and count % 1000 == 0:
            print(f"\r{count} lines, {errors} rejected", end="", file=sys.stderr, flush=True)
    sink.flush()
    if progress and count >= 1000:
        print(file=sys.stderr)
    return count, errors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render_cmd = commands.add_parser("render", help="render JSONL request bodies (stdin) to prompts")
    render_cmd.add_argument("--api", choices=APIS, required=True)
    render_cmd.add_argument("--model", help="render every request for this model name")
    render_cmd.add_argument("--tokens", action="store_true", help="also write the prompt token ids")
    render_cmd.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: the DeepSeek V4 tokenizer)")
    parse_cmd = commands.add_parser("parse", help="parse JSONL model outputs (stdin) into API responses")
    parse_cmd.add_argument("--api", choices=APIS, required=True)
    parse_cmd.add_argument("--request", type=Path, required=True, help="the request body (JSON) the outputs answer")
    parse_cmd.add_argument("--events", action="store_true", help="write the stream events instead of the response")
    parse_cmd.add_argument("--tokenizer", type=Path, help="a tokenizer.json for token_ids lines")
    args = parser.parse_args(argv)

    lines = sys.stdin.buffer
    if args.command == "render":
        tokenizer = load_tokenizer(args.tokenizer) if args.tokens else None
        outputs = render_lines(lines, args.api, args.model, tokenizer)
    else:
        try:
            converted = convert(args.api, args.request.read_bytes())
        except (OSError, RecipeError) as error:
            print(f"python -m recipe parse: {args.request}: {error}", file=sys.stderr)
            return 2
        outputs = parse_lines(lines, converted, args.events, functools.partial(load_tokenizer, args.tokenizer))
    count, errors = _write(outputs, sys.stdout.buffer, progress=sys.stderr.isatty())
    print(f"{args.command}: {count} lines, {errors} rejected", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
