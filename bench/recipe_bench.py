"""recipe vs deepseek-recipe 0.2.0, side by side in one process on the same inputs.

(a) convert + render: requests/s on a realistic 21-message conversation with tools and reasoning
    (message text taken from a real agent session in ../shared/data/agent-traces when present), once as
    an agent session sends it (the same tools and earlier calls every turn: our memoised schema lines and
    call parameters hit) and once with tools and calls never seen before (every request different).
(b) streaming parse: MB/s and chunks/s on a long reasoning + answer + DSML output cut into 4-character
    chunks, with every event materialised (JSON bytes), for each API.
(c) token-mode parse (ours only, with the reference for scale): token ids one per push.

Rounds alternate ours and the reference and each side keeps its best round; time is the process's CPU
time, so other load on a shared machine does not count against either side. Prints a table with ratios
and writes JSON (default bench/out/recipe.json).

    python bench/recipe_bench.py [--rounds 5] [--seconds 1.0] [--out bench/out/recipe.json]
"""

from __future__ import annotations

import argparse
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


def conversation_body() -> dict[str, Any]:
    """21 messages (system, 10 user/tool turns, 10 assistant turns with reasoning and tool calls), 5 tools."""
    texts = _trace_texts()
    tools = [
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
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful software engineer."}]
    for turn in range(10):
        if turn % 2 == 0:
            messages.append({"role": "user", "content": texts[turn][:400]})
            messages.append(
                {"role": "assistant", "content": texts[10 + turn][:300], "reasoning_content": texts[20 + turn][:250]}
            )
        else:
            call_id = f"call_{turn}"
            arguments = json.dumps({"path": f"src/module_{turn}.py", "command": "pytest -q", "timeout": 12.5})
            call = {"id": call_id, "type": "function", "function": {"name": "run_command", "arguments": arguments}}
            messages.append(
                {"role": "assistant", "content": "", "reasoning_content": texts[turn][:300], "tool_calls": [call]}
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": texts[30 + turn][:400]})
    return {"model": "DeepSeek-V4.1-Flash", "messages": messages[:21], "tools": tools}


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


def best_rate(work: Callable[[], int], rounds: int, seconds: float) -> float:
    """Items per second of `work` (which returns its item count): the best of `rounds` timed rounds."""
    best = 0.0
    for _ in range(rounds):
        done, start = 0, time.process_time()
        while time.process_time() - start < seconds:
            done += work()
        best = max(best, done / (time.process_time() - start))
    return best


def side_by_side(
    ours: Callable[[], int], theirs: Callable[[], int], rounds: int, seconds: float
) -> tuple[float, float]:
    """Interleaved rounds of both sides, each side's best."""
    mine = reference = 0.0
    for _ in range(rounds):
        mine = max(mine, best_rate(ours, 1, seconds))
        reference = max(reference, best_rate(theirs, 1, seconds))
    return mine, reference


def unseen_variants(count: int) -> list[bytes]:
    """The conversation with tool descriptions and call arguments made unique per variant."""
    variants = []
    for number in range(count):
        body = conversation_body()
        for tool in body["tools"]:
            tool["function"]["description"] += f" (variant {number})"
        for message in body["messages"]:
            for call in message.get("tool_calls", ()):
                call["function"]["arguments"] = call["function"]["arguments"].replace("12.5", f"{number}.5")
        variants.append(json.dumps(body).encode())
    return variants


def bench_render(rounds: int, seconds: float) -> dict[str, Any]:
    body = json.dumps(conversation_body()).encode()
    options = dr.ConversionOptions()
    encoding = dr.DeepseekV41Encoding()

    def render_ours(raw: bytes) -> int:
        converted = convert("chat.completions", raw)
        return len(render(converted.conversation, converted.version).text) and 1

    def render_theirs(raw: bytes) -> int:
        converted = dr.ChatCompletionRequest(raw).convert(options)
        return len(encoding.render_conversation(converted.conversation).prompt) and 1

    converted = convert("chat.completions", body)
    text = render(converted.conversation, converted.version).text
    assert text == encoding.render_conversation(dr.ChatCompletionRequest(body).convert(options).conversation).prompt
    session = side_by_side(lambda: render_ours(body), lambda: render_theirs(body), rounds, seconds)
    variants = unseen_variants(4_000)
    position = {"ours": 0, "theirs": 0}

    def next_variant(side: str) -> bytes:
        position[side] = (position[side] + 1) % len(variants)
        return variants[position[side]]

    unseen = side_by_side(
        lambda: render_ours(next_variant("ours")), lambda: render_theirs(next_variant("theirs")), rounds, seconds
    )
    return {
        "messages": len(json.loads(body)["messages"]),
        "prompt_chars": len(text),
        "ours_per_s": session[0],
        "reference_per_s": session[1],
        "unseen_ours_per_s": unseen[0],
        "unseen_reference_per_s": unseen[1],
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

    mine, reference = side_by_side(ours, theirs, rounds, seconds)
    megabytes = len(text.encode()) / 1e6
    return {
        "bytes": len(text.encode()),
        "chunks": len(chunks),
        "ours_mb_per_s": mine * megabytes,
        "reference_mb_per_s": reference * megabytes,
        "ours_chunks_per_s": mine * len(chunks),
        "reference_chunks_per_s": reference * len(chunks),
    }


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

    mine, reference = side_by_side(ours, theirs, rounds, seconds)
    return {"tokens": len(ids), "ours_tokens_per_s": mine, "reference_tokens_per_s": reference}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one timed round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "recipe.json")
    args = parser.parse_args()

    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "reference": f"deepseek-recipe {dr.__version__}",
        "render": bench_render(args.rounds, args.seconds),
        "stream": {api: bench_stream(api, args.rounds, args.seconds) for api in STREAM_BODIES},
        "tokens": bench_tokens(args.rounds, args.seconds),
    }
    info = results["render"]
    rows = [
        ("(a) convert+render, requests/s", info["ours_per_s"], info["reference_per_s"]),
        ("(a) … unseen tools and calls, requests/s", info["unseen_ours_per_s"], info["unseen_reference_per_s"]),
    ]
    for api, stream in results["stream"].items():
        rows.append((f"(b) parse {api}, MB/s", stream["ours_mb_per_s"], stream["reference_mb_per_s"]))
        rows.append((f"(b) parse {api}, chunks/s", stream["ours_chunks_per_s"], stream["reference_chunks_per_s"]))
    tokens = results["tokens"]
    rows.append(("(c) token-mode parse, tokens/s", tokens["ours_tokens_per_s"], tokens["reference_tokens_per_s"]))
    table = Table(title=f"recipe vs {results['reference']} ({results['machine']})")
    for column in ("benchmark", "recipe", "deepseek-recipe", "ratio"):
        table.add_column(column, justify="left" if column == "benchmark" else "right")
    for name, mine, reference in rows:
        table.add_row(name, f"{mine:,.1f}", f"{reference:,.1f}", f"{mine / reference:.2f}x")
    Console(width=120).print(table)
    print(f"(a) conversation: {info['messages']} messages, {info['prompt_chars']:,} prompt characters")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
