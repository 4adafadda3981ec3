"""`python -m mesh demo [--base-url URL]`: a short scripted conversation with the real `openai` SDK, streamed and
printed turn by turn with what each turn cost (prompt tokens, how many came from the prefix cache, time to first
token, tokens/s). Without --base-url it starts its own mesh for the length of the demo.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec

from mesh.config import load_config
from mesh.processes import Mesh, MeshError, MeshSpec
from mesh.up import DEFAULT_MODEL

SYSTEM = "You are a concise assistant for engineers who run LLM servers."
SCRIPT = (
    "Hi! In one sentence: what is a KV cache?",
    "Why does reusing a cached prompt prefix make the next turn faster?",
    "Thanks. Sum up our conversation in five words.",
)


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Talk to the mesh with the openai SDK.

    base_url: a running gateway (e.g. http://127.0.0.1:8000); empty starts a mesh for the demo
    api_key: the gateway's API key, if it requires one
    model: the model the demo's own mesh serves
    data_dir: the demo mesh's data directory (default: a temporary one)
    max_tokens: output budget of each turn
    thinking: let the model think before answering (its reasoning is printed dimmed)
    """

    base_url: str = ""
    api_key: str = ""
    model: str = DEFAULT_MODEL
    data_dir: str = ""
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 48
    thinking: bool = False


def _extra(delta: Any, name: str) -> str:
    return (getattr(delta, "model_extra", None) or {}).get(name) or ""


def converse(base_url: str, api_key: str, max_tokens: int, thinking: bool, out: Any = sys.stdout) -> list[dict]:
    """Run the script against `base_url`; returns each turn's usage."""
    from openai import OpenAI

    dim, reset = ("\033[2m", "\033[0m") if out.isatty() else ("", "")
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    usages = []
    for turn, text in enumerate(SCRIPT, 1):
        messages.append({"role": "user", "content": text})
        print(f"\n[{turn}] user: {text}\n[{turn}] {model}: ", end="", file=out, flush=True)
        started, first, answer = time.monotonic(), None, []
        stream = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}},
        )
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning, content = _extra(delta, "reasoning_content"), delta.content or ""
            if (reasoning or content) and first is None:
                first = time.monotonic()
            if reasoning:
                print(dim + reasoning + reset, end="", file=out, flush=True)
            if content:
                answer.append(content)
                print(content, end="", file=out, flush=True)
        elapsed = time.monotonic() - started
        messages.append({"role": "assistant", "content": "".join(answer)})
        if usage is not None:
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            ttft = (first or time.monotonic()) - started
            rate = usage.completion_tokens / max(elapsed - ttft, 1e-6)
            cost = f"{usage.prompt_tokens} prompt tokens ({cached} cached), {usage.completion_tokens} generated"
            speed = f"first token after {ttft:.2f} s, {rate:.0f} tokens/s"
            print(f"\n    {dim}{cost}; {speed}{reset}", file=out, flush=True)
            usages.append({"prompt_tokens": usage.prompt_tokens, "cached_tokens": cached})
    print(file=out)
    return usages


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(DemoConfig, argv, env_prefix="MESH_DEMO", prog="python -m mesh demo")
    if cfg.base_url:
        converse(cfg.base_url, cfg.api_key, cfg.max_tokens, cfg.thinking)
        return 0
    with tempfile.TemporaryDirectory(prefix="v41mesh-demo-") as scratch:
        spec = MeshSpec(model=cfg.model, data_dir=Path(cfg.data_dir or scratch), api_key=cfg.api_key)
        mesh = Mesh(spec, on_event=lambda line: print("  " + line, file=sys.stderr, flush=True))
        print(f"starting a {cfg.model} mesh for the demo ...", file=sys.stderr, flush=True)
        try:
            mesh.start()
        except MeshError as exc:
            print(f"the mesh could not start: {exc}", file=sys.stderr)
            return 1
        try:
            converse(mesh.base_url, cfg.api_key, cfg.max_tokens, cfg.thinking)
        finally:
            mesh.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
