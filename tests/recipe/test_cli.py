"""`python -m recipe render|parse` as a batch tool: real subprocesses, real files, one bad line never stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import recipe_oracle as oracle

V41 = "DeepSeek-V4.1-Flash"


def run(args: list[str], lines: list[str]) -> tuple[list[dict], str]:
    done = subprocess.run(
        [sys.executable, "-m", "recipe", *args],
        input="\n".join(lines).encode(),
        capture_output=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr.decode()


def test_render_batch_survives_bad_lines() -> None:
    good = {"model": V41, "messages": [{"role": "user", "content": "Hello"}], "thinking": {"type": "disabled"}}
    lines = [json.dumps(good), "{not json", json.dumps({**good, "model": "gpt-4"}), json.dumps(good)]
    out, summary = run(["render", "--api", "chat.completions", "--tokens"], lines)
    assert out[0] == {
        "prompt": oracle.prompt("chat.completions", good),
        "token_ids": [0, 128803, 19923, 128804, 128822],
    }
    assert out[1]["error"]["status"] == 400
    assert out[2]["error"] == {"status": 400, "message": out[2]["error"]["message"], "param": "model"}
    assert out[3] == out[0]
    assert "4 lines, 2 rejected" in summary


def test_render_model_override() -> None:
    body = {"model": V41, "messages": [{"role": "user", "content": "Hi"}]}
    out, _ = run(["render", "--api", "chat.completions", "--model", "DeepSeek-V4-Pro"], [json.dumps(body)])
    assert out[0]["prompt"] == oracle.prompt("chat.completions", {**body, "model": "DeepSeek-V4-Pro"})


def test_parse_responses_and_events(tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": V41, "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]}))
    lines = [json.dumps({"chunks": ["Let me ", "think</think>Hel", "lo"], "finish": "stop"}), json.dumps({"chunks": 3})]
    out, _ = run(["parse", "--api", "messages", "--request", str(request)], lines)
    assert out[0]["content"] == [
        {"type": "thinking", "thinking": "Let me think", "signature": out[0]["id"]},
        {"type": "text", "text": "Hello"},
    ]
    assert out[1]["error"]["param"] == "chunks"
    events, _ = run(["parse", "--api", "messages", "--request", str(request), "--events"], lines[:1])
    assert [e["event"] for e in events[0]][:3] == ["message_start", "content_block_start", "ping"]
    assert events[0][-1] == {"event": "message_stop", "data": {"type": "message_stop"}}


def test_parse_token_ids(tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": V41, "messages": [{"role": "user", "content": "q"}]}))
    # "Hello" then the real </think> token, then "Hello": reasoning and answer split by the template token.
    out, _ = run(
        ["parse", "--api", "chat.completions", "--request", str(request)], ['{"token_ids": [19923, 128822, 19923]}']
    )
    message = out[0]["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Hello", "Hello")


def test_parse_rejects_a_bad_request_file(tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text('{"model": "nope"}')
    done = subprocess.run(
        [sys.executable, "-m", "recipe", "parse", "--api", "chat.completions", "--request", str(request)],
        input=b"",
        capture_output=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert b"messages" in done.stderr or b"model" in done.stderr
