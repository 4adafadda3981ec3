"""recipe vs deepseek-recipe 0.2.0, side by side in one process on the same inputs.

(a) convert + render: requests/s on conversations of several shapes, with message text taken from a real agent
    session in ../shared/data/agent-traces when present: a 21-message mix of chat and tool turns with 5 tools, and
    32-message agent loops (every assistant turn reasoning and one tool call, each answered by a tool message)
    with flat arguments, nested JSON arguments, short turns, and 4 KB tool outputs. Each shape runs as an agent
    session sends it (the same tools and earlier calls every turn: our memoised schema lines and call parameters
    hit) and with tools and calls never seen before (every request different); the agent loop once more with the
    last 500 converted requests kept alive, as a busy server keeps those in flight.
(b) streaming parse: MB/s and chunks/s on a long reasoning + answer + DSML output cut into 4-character
    chunks, with every event materialised (JSON bytes), for each API.
(c) token-mode parse (ours only, with the reference for scale): token ids one per push.

Rounds alternate ours and the reference; each row reports each side's best round and the spread of the round-by-
round ratios. Time is the process's CPU time, so other load on a shared machine does not count against either
side. Prints a table and writes JSON (default bench/out/recipe.json).

    python bench/recipe_bench.py [--rounds 5] [--seconds 1.0] [--out bench/out/recipe.json]
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepseek_recipe as dr
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe import StreamProcessor, convert, load_tokenizer, render  # noqa: E402

TRACES = ROOT / ".." / "shared" / "data" / "agent-traces"
API_REQUEST = {
    "chat.completions": dr.ChatCompletionRequest,
    "responses": dr.ResponsesRequest,
    "messages": dr.MessagesRequest,
}


def _trace_texts() -> list[str]:
    """Realistic message text: a real agent session's prompts and outputs (or a fixed stand-in)."""
    sessions = sorted(TRACES.glob("miniswe/*.jsonl"))
    if not sessions:
        return ["Please look into the failing test in tests/test_io.py and fix the bug. " * 20] * 30
    calls = [json.loads(line) for line in sessions[0].read_text().splitlines()]
    return [c["output"] for c in calls] + [c["input"][-1500:] for c in calls]


def _tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name.replace('_', ' ').capitalize()} in the repository.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "A path relative to the repository root."},
                        "command": {"type": "string", "description": "The shell command to run."},
                        "timeout": {"type": "number", "description": "Seconds before giving up.", "default": 30.0},
                    },
                    "required": ["path"],
                },
            },
        }
        for name in ("run_command", "read_file", "write_file", "search_code", "run_tests")
    ]


def _call(number: int, arguments: dict[str, Any]) -> dict[str, Any]:
    function = {"name": "run_command", "arguments": json.dumps(arguments)}
    return {"id": f"call_{number}", "type": "function", "function": function}


def mixed_body() -> dict[str, Any]:
    """21 messages (system, 10 user/tool turns, 10 assistant turns with reasoning and tool calls), 5 tools."""
    texts = _trace_texts()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful software engineer."}]
    for turn in range(10):
        if turn % 2 == 0:
            messages.append({"role": "user", "content": texts[turn][:400]})
            messages.append(
                {"role": "assistant", "content": texts[10 + turn][:300], "reasoning_content": texts[20 + turn][:250]}
            )
        else:
            call = _call(turn, {"path": f"src/module_{turn}.py", "command": "pytest -q", "timeout": 12.5})
            messages.append(
                {"role": "assistant", "content": "", "reasoning_content": texts[turn][:300], "tool_calls": [call]}
            )
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": texts[30 + turn][:400]})
    return {"model": "DeepSeek-V4.1-Flash", "messages": messages[:21], "tools": _tools()}


def _flat_arguments(turn: int) -> dict[str, Any]:
    return {"path": f"src/module_{turn}.py", "command": "pytest -q", "timeout": 12.5}


def _nested_arguments(turn: int) -> dict[str, Any]:
    """A booking as a travel agent's tool call carries it: objects in a list, numbers, booleans, nulls."""
    flights = [
        {
            "flight_number": f"HAT{100 + turn + leg:03d}",
            "origin": "IAH",
            "destination": "SFO",
            "date": f"2024-05-{10 + leg:02d}",
            "prices": {"basic_economy": 50 + leg, "economy": 141.5, "business": 391},
            "refundable": leg % 2 == 0,
            "seat": None,
        }
        for leg in range(3)
    ]
    return {"reservation_id": f"HX{turn:04d}", "cabin": "economy", "flights": flights, "total": 782.25}


def agent_body(
    *, text_chars: int = 300, output_chars: int = 400, arguments: Callable[[int], dict[str, Any]] = _flat_arguments
) -> dict[str, Any]:
    """32 messages: a system prompt, the task, then 15 assistant turns, each with reasoning and one tool call and
    answered by a tool message; 5 tools."""
    texts = _trace_texts()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful software engineer."},
        {"role": "user", "content": texts[0][:text_chars]},
    ]
    for turn in range(1, 16):
        call = _call(turn, arguments(turn))
        reasoning = texts[(3 * turn) % len(texts)][:text_chars]
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]})
        output = texts[(7 * turn) % len(texts)]
        output = (output * (output_chars // max(1, len(output)) + 1))[:output_chars]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return {"model": "DeepSeek-V4.1-Flash", "messages": messages, "tools": _tools()}


SHAPES: dict[str, Callable[[], dict[str, Any]]] = {
    "21-message mix": mixed_body,
    "32-message agent loop": agent_body,
    "… nested JSON arguments": lambda: agent_body(arguments=_nested_arguments),
    "… short turns (40 chars)": lambda: agent_body(text_chars=40, output_chars=40),
    "… 4 KB tool outputs": lambda: agent_body(output_chars=4000),
}


def long_output() -> str:
    """About 50 KB: reasoning, `</think>`, an answer, then 50 DSML tool calls."""
    reasoning = (
        "Let me think about this carefully. The user wants the weather in several cities, so I will call the tool. "
        * 200
    )
    answer = "Here is what I found about the weather today, including temperatures and forecasts. " * 200
    parameter = '<｜DSML｜ parameter name="{}" string="{}">{}</｜DSML｜ parameter>'
    calls = "\n".join(
        f'<｜DSML｜ invoke name="get_weather">\n{parameter.format("city", "true", f"City number {i} with a long name")}'
        f"\n{parameter.format('days', 'false', i)}\n</｜DSML｜ invoke>"
        for i in range(50)
    )
    return f"{reasoning}</think>{answer}\n\n<｜DSML｜ calls>\n{calls}\n</｜DSML｜ calls>"


STREAM_BODIES = {
    "chat.completions": {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "stream": True,
    },
    "responses": {
        "model": "DeepSeek-V4.1-Flash",
        "input": "q",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "stream": True,
    },
    "messages": {
        "model": "DeepSeek-V4.1-Flash",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "stream": True,
    },
}


def rate(work: Callable[[], int], seconds: float) -> float:
    """Items per second of `work` (which returns its item count) over one timed round of process CPU time."""
    done, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        done += work()
    return done / (time.process_time() - start)


class Pair:
    """Both sides' rates, round by round (the rounds alternate the sides)."""

    def __init__(self, ours: list[float], theirs: list[float]) -> None:
        self.ours, self.theirs = ours, theirs

    @property
    def best(self) -> tuple[float, float]:
        return max(self.ours), max(self.theirs)

    @property
    def spread(self) -> tuple[float, float]:
        """The lowest and highest ratio of a round to the round of the other side next to it."""
        ratios = [mine / reference for mine, reference in zip(self.ours, self.theirs, strict=True)]
        return min(ratios), max(ratios)

    def json(self) -> dict[str, Any]:
        return {"ours_per_s": self.ours, "reference_per_s": self.theirs, "ratio_best": self.best[0] / self.best[1],
                "ratio_spread": self.spread}  # fmt: skip


def side_by_side(ours: Callable[[], int], theirs: Callable[[], int], rounds: int, seconds: float) -> Pair:
    """Interleaved rounds of both sides."""
    mine: list[float] = []
    reference: list[float] = []
    for _ in range(rounds):
        mine.append(rate(ours, seconds))
        reference.append(rate(theirs, seconds))
    return Pair(mine, reference)


def unseen(body: dict[str, Any]) -> Callable[[], bytes]:
    """A source of `body` made new on every call: tool descriptions and call arguments carry a serial number, so
    nothing is memoised on either side."""
    marked = copy.deepcopy(body)
    for tool in marked["tools"]:
        tool["function"]["description"] += " (variant @@)"
    for message in marked["messages"]:
        for call in message.get("tool_calls", ()):
            arguments = json.loads(call["function"]["arguments"])
            call["function"]["arguments"] = json.dumps({"request": "@@", **arguments})
    head, *rest = json.dumps(marked).encode().split(b"@@")
    serial = itertools.count()

    def next_body() -> bytes:
        number = str(next(serial)).encode()
        return head + b"".join(number + part for part in rest)

    return next_body


_OPTIONS = dr.ConversionOptions()
_ENCODING = dr.DeepseekV41Encoding()


ALIVE = 500


def _render_ours(raw: bytes, alive: collections.deque[Any] | None = None) -> int:
    converted = convert("chat.completions", raw)
    if alive is not None:
        alive.append(converted)
    return len(render(converted.conversation, converted.version).text) and 1


def _render_theirs(raw: bytes, alive: collections.deque[Any] | None = None) -> int:
    converted = dr.ChatCompletionRequest(raw).convert(_OPTIONS)
    if alive is not None:
        alive.append(converted)
    return len(_ENCODING.render_conversation(converted.conversation).prompt) and 1


def _same_prompt(raw: bytes) -> str:
    """The prompt of `raw`, which both sides must render byte for byte."""
    text = render(convert("chat.completions", raw).conversation).text
    reference = dr.ChatCompletionRequest(raw).convert(_OPTIONS).conversation
    assert text == _ENCODING.render_conversation(reference).prompt
    return text


def bench_shape(body: dict[str, Any], rounds: int, seconds: float, alive: bool = False) -> dict[str, Any]:
    """Convert + render of one conversation shape: as a session resends it, and never seen before (`alive`: also
    never seen before, with the last `ALIVE` converted requests of each side kept)."""
    raw = json.dumps(body).encode()
    text = _same_prompt(raw)
    _same_prompt(unseen(body)())
    session = side_by_side(lambda: _render_ours(raw), lambda: _render_theirs(raw), rounds, seconds)
    ours_source, theirs_source = unseen(body), unseen(body)
    fresh = side_by_side(lambda: _render_ours(ours_source()), lambda: _render_theirs(theirs_source()), rounds, seconds)
    pairs = [("session", session), ("unseen", fresh)]
    if alive:
        kept_ours: collections.deque[Any] = collections.deque(maxlen=ALIVE)
        kept_theirs: collections.deque[Any] = collections.deque(maxlen=ALIVE)
        kept = side_by_side(
            lambda: _render_ours(ours_source(), kept_ours),
            lambda: _render_theirs(theirs_source(), kept_theirs),
            rounds,
            seconds,
        )
        pairs.append(("alive", kept))
    return {
        "messages": len(body["messages"]),
        "prompt_chars": len(text),
        **{name: pair.json() for name, pair in pairs},
        "pairs": pairs,
    }


def bench_stream(api: str, rounds: int, seconds: float) -> dict[str, Any]:
    body = STREAM_BODIES[api]
    text = long_output()
    chunks = [text[i : i + 4] for i in range(0, len(text), 4)]
    converted = convert(api, body)  # type: ignore[arg-type]
    request_type = API_REQUEST[api]
    reference_request = request_type(json.dumps(body).encode()).convert(dr.ConversionOptions())

    def ours() -> int:
        processor = StreamProcessor(converted)
        size = sum(len(e.data) for e in processor.start())
        for chunk in chunks:
            for event in processor.push_text(chunk, 1):
                size += len(event.data)
        size += sum(len(e.data) for e in processor.finish("stop"))
        return 1 if size else 0

    def theirs() -> int:
        processor = dr.StreamProcessor(
            request_type.chunk_generator(reference_request, "ID", "MODEL"), reference_request.parsing_options
        )
        size = 0
        for chunk in chunks:
            for event in processor.push(dr.InferenceChunk.text(chunk, 1)):
                size += len(event.to_json())
        for event in processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + processor.finish():
            size += len(event.to_json())
        return 1 if size else 0

    pair = side_by_side(ours, theirs, rounds, seconds)
    megabytes = len(text.encode()) / 1e6
    return {"bytes": len(text.encode()), "chunks": len(chunks), "megabytes": megabytes, **pair.json(), "pair": pair}


def bench_tokens(rounds: int, seconds: float) -> dict[str, Any]:
    tokenizer = load_tokenizer()
    text = long_output()
    ids = tokenizer.hf.encode(text, add_special_tokens=False).ids
    body = STREAM_BODIES["chat.completions"]
    converted = convert("chat.completions", body)
    reference_tokenizer = dr.Tokenizer.from_str(tokenizer.hf.to_str())
    reference_request = dr.ChatCompletionRequest(json.dumps(body).encode()).convert(dr.ConversionOptions())

    def ours() -> int:
        processor = StreamProcessor(converted, tokenizer=tokenizer)
        for token_id in ids:
            for event in processor.push_tokens((token_id,)):
                len(event.data)
        processor.finish("stop")
        return len(ids)

    def theirs() -> int:
        generator = dr.ChatCompletionRequest.chunk_generator(reference_request, "ID", "MODEL")
        processor = dr.StreamProcessor(generator, reference_request.parsing_options, reference_tokenizer)
        for token_id in ids:
            for event in processor.push(dr.InferenceChunk.tokens([token_id])):
                event.to_json()
        processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
        return len(ids)

    pair = side_by_side(ours, theirs, rounds, seconds)
    return {"tokens": len(ids), **pair.json(), "pair": pair}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one timed round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "recipe.json")
    args = parser.parse_args()

    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "reference": f"deepseek-recipe {dr.__version__}",
        "render": {
            shape: bench_shape(make(), args.rounds, args.seconds, alive=shape == "32-message agent loop")
            for shape, make in SHAPES.items()
        },
        "stream": {api: bench_stream(api, args.rounds, args.seconds) for api in STREAM_BODIES},
        "tokens": bench_tokens(args.rounds, args.seconds),
    }
    rows: list[tuple[str, Pair, float]] = []
    labels = {"unseen": "(a) … unseen tools and calls, req/s", "alive": f"(a) … unseen, last {ALIVE} kept alive, req/s"}
    for shape, info in results["render"].items():
        for name, pair in info.pop("pairs"):
            label = f"(a) {shape} ({info['messages']} msgs, {info['prompt_chars']:,} chars), req/s"
            rows.append((labels.get(name, label), pair, 1.0))
    for api, stream in results["stream"].items():
        pair = stream.pop("pair")
        rows.append((f"(b) parse {api}, MB/s", pair, stream["megabytes"]))
        rows.append((f"(b) parse {api}, chunks/s", pair, stream["chunks"]))
    rows.append(("(c) token-mode parse, tokens/s", results["tokens"].pop("pair"), 1.0))
    table = Table(title=f"recipe vs {results['reference']} ({results['machine']}), best of {args.rounds} rounds")
    for column in ("benchmark", "recipe", "deepseek-recipe", "ratio", "round ratios"):
        table.add_column(column, justify="left" if column == "benchmark" else "right")
    for name, pair, scale in rows:
        mine, reference = pair.best
        low, high = pair.spread
        table.add_row(name, f"{mine * scale:,.1f}", f"{reference * scale:,.1f}", f"{mine / reference:.2f}x",
                      f"{low:.2f}–{high:.2f}x")  # fmt: skip
    Console(width=150).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
