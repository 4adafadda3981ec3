"""Real text from coding and customer-service agent sessions (../shared/data/agent-traces): their
`input` texts as message content render like deepseek-recipe, their `output` texts parse like it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import recipe_oracle as oracle

from recipe import APIS, StreamProcessor, Tokenizer, convert, render

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "agent-traces"
V41, V4 = "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"
TOOL = {"name": "bash", "description": "Run a shell command", "parameters": {"type": "object"}}


def _samples() -> list[dict[str, Any]]:
    """The first and last call of every session (the shared data is read in place, never copied)."""
    if not TRACES.is_dir():
        return []
    samples = []
    for session in sorted(TRACES.glob("*/*.jsonl")):
        lines = session.read_text().splitlines()
        for line in (lines[0], lines[-1]):
            call = json.loads(line)
            samples.append({"id": f"{session.parent.name}/{session.stem[:8]}", **call})
    return samples


SAMPLES = _samples()
needs_traces = pytest.mark.skipif(not SAMPLES, reason=f"agent traces not found at {TRACES}")


def _request(api: str, text: str, model: str) -> dict[str, Any]:
    if api == "responses":
        return {"model": model, "input": text, "tools": [{"type": "function", **TOOL}]}
    if api == "messages":
        tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
        return {"model": model, "max_tokens": 4096, "messages": [{"role": "user", "content": text}], "tools": [tool]}
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "tools": [{"type": "function", "function": TOOL}],
    }


@needs_traces
@pytest.mark.parametrize("api", APIS)
def test_trace_inputs_render_like_reference(api: str, tokenizer: Tokenizer) -> None:
    tokenizer_json = oracle.tokenizer_json(tokenizer)
    for number, sample in enumerate(SAMPLES):
        body = _request(api, sample["input"], V4 if number % 2 else V41)
        converted = convert(api, body)
        ours = render(converted.conversation, converted.version, tokenizer if number % 8 == 0 else None)
        assert ours.text == oracle.prompt(api, body), sample["id"]
        if ours.token_ids is not None:
            assert ours.token_ids == oracle.token_ids(api, body, tokenizer_json), sample["id"]


@needs_traces
@pytest.mark.parametrize("api", APIS)
def test_trace_outputs_parse_like_reference(api: str) -> None:
    for number, sample in enumerate(SAMPLES):
        body = {**_request(api, "q", V41), "stream": True}
        output = sample["output"]
        size = 3 + number % 13
        chunks = [output[i : i + size] for i in range(0, len(output), size)]
        processor = StreamProcessor(convert(api, body), id="ID", created=0, model="MODEL")
        processor.start(10, 3, "fp")
        for chunk in chunks:
            processor.push_text(chunk, 1)
        processor.finish("stop")
        _, expected = oracle.run_stream(api, body, chunks, "stop")
        assert oracle.normalize(processor.response()) == oracle.normalize(expected), sample["id"]
