"""The mesh under agent traffic (issue 6's performance section): ours and its two baselines in one run.

    python bench/serve_bench.py [--model tiny] [--sessions 6] [--calls 12] [--max-tokens 16] [--concurrency 8]
                                [--configs ours,no-reuse,no-dspark] [--rounds 3] [--out bench/out/serve_bench.json]
    python bench/serve_bench.py --configs ours,two-gateways --sessions 3 --calls 8

Replays the agent sessions of ../shared/data/agent-traces/{miniswe,taubench}/ through the gateway with the real
`openai` SDK (streamed Chat Completions, greedy, thinking off): sessions start in timestamp order, `--concurrency`
of them at once, each replaying its calls one after another with the call's `input` as the user message and
`--max-tokens` as the budget. A session's inputs grow turn by turn, so later calls share long prefixes with
earlier ones. A session is cut at its first call that does not fit the model's context (counted as skipped).

The traces flatten a conversation into one user message per call, so a call's prompt never extends the previous
call's prompt *and reply*: the end-of-sequence SWA record never matches and the write-back wait buys nothing. With
`--turns` a session is replayed as a real conversation instead: a call whose input extends the previous call's
sends the previous messages, the reply the mesh generated as the assistant's turn, and the new text as the next
user message (an input that does not extend the previous one opens a new conversation), so the next turn can
continue from the SWA record its previous turn wrote back.

Each configuration runs on a mesh of its own (`mesh.processes.Mesh`, same machine, same data), all of them up at once
and warmed by a call; then `--rounds` rounds replay the sessions on every mesh in turn, in an order rotating by round,
each round under a cache salt of its own (a round reuses its own prefixes, never an earlier round's). The tables give
each figure's median over the rounds, with the spread (min–max) of TTFT p50 and output tokens/s. Configurations:
- ours: prefix reuse on, DSpark on (the defaults);
- no-reuse: the gateway gives every request its own cache salt (`--no-prefix-reuse`), so nothing is reused;
- no-dspark: decode without speculation (`--no-speculation`);
- two-gateways (only when asked for in --configs): ours with two gateways over the same replicas, call i of every
  session sent to gateway i mod 2 — a load balancer without stickiness, the worst case for the write-back wait,
  which only the gateway that served the previous turn knows (docs/gateway.md, "Routing").

Reported per configuration: TTFT and ITL (gap between streamed chunks) p50/p99, TPOT, output tokens/s over the run,
the cached share of prompt tokens, bounded replays, write-back waits (turns that waited for their previous turn's
write-back, all gateways, and their mean wait), DSpark acceptance (accepted / proposed drafts) and tokens per decode
step, errors; and decode's share of a TTFT, from the decode replica's metrics: the mean wait before the engine takes
a prompt in (its running step), the mean join (restore + decoder bounded replay, one forward for the prompts of an
iteration), prompts per join, and the mean step. Ratios: TTFT p50 no-reuse / ours (target ≥ 4×), output tokens/s
ours / no-dspark, TTFT p50 two-gateways / ours.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mesh.processes import Mesh, MeshSpec  # noqa: E402
from recipe import convert, load_tokenizer, render  # noqa: E402

TRACES = ROOT.parent / "shared/data/agent-traces"
MODEL_NAME = "DeepSeek-V4.1-Flash"


@dataclass(frozen=True)
class Config:
    """How a configuration's mesh differs from ours."""

    gateway_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    gateways: int = 1  # call i of a session goes to gateway i mod gateways


CONFIGS = {
    "ours": Config(),
    "no-reuse": Config(gateway_args=("--no-prefix-reuse",)),
    "no-dspark": Config(decode_args=("--no-speculation",)),
    "two-gateways": Config(gateways=2),
}
DEFAULT_CONFIGS = ("ours", "no-reuse", "no-dspark")
TURN_TEMPLATE_TOKENS = 8  # an assistant turn's and the next user turn's tags, at most (--turns)
console = Console(width=200)


@dataclass
class Session:
    name: str
    started: int  # first call's timestamp (µs)
    inputs: list[str]


@dataclass
class CallResult:
    session: str
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None


def prompt_tokens(text: str, tokenizer: Any) -> int:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "thinking": {"type": "disabled"}}
    request = convert("chat.completions", json.dumps(body))
    return len(render(request.conversation, request.version, tokenizer).token_ids or [])


def load_sessions(
    traces: Path, datasets: list[str], per_dataset: int, calls: int, room: int
) -> tuple[list[Session], int]:
    """The first `per_dataset` sessions of each dataset under `traces` (by start time), each cut at `calls` calls and
    at its first call longer than `room` prompt tokens; all sessions in timestamp order. Returns them and the calls
    cut."""
    tokenizer = load_tokenizer()
    sessions: list[Session] = []
    skipped = 0
    for dataset in datasets:
        found = []
        for path in sorted((traces / dataset).glob("*.jsonl")):
            rows = sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                          key=lambda row: row["timestamp"])  # fmt: skip
            found.append(Session(f"{dataset}/{path.stem[:8]}", rows[0]["timestamp"], [r["input"] for r in rows]))
        for session in sorted(found, key=lambda s: s.started)[:per_dataset]:
            kept = []
            for text in session.inputs[:calls]:
                if prompt_tokens(text, tokenizer) > room:
                    break
                kept.append(text)
            skipped += min(len(session.inputs), calls) - len(kept)
            sessions.append(Session(session.name, session.started, kept))
    return sorted(sessions, key=lambda s: s.started), skipped


def next_turn(messages: list[dict[str, str]], previous: str | None, reply: str, text: str) -> list[dict[str, str]]:
    """The conversation that sends `text` next: `messages`, `reply` and the part of `text` after `previous` when
    `text` extends it (`--turns`), else `text` alone."""
    if previous is None or len(text) <= len(previous) or not text.startswith(previous):
        return [{"role": "user", "content": text}]
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": text[len(previous) :]}]


async def one_call(
    client: Any, session: str, messages: list[dict[str, str]], max_tokens: int, salt: str | None = None
) -> CallResult:
    result = CallResult(session)
    extra: dict[str, Any] = {"thinking": {"type": "disabled"}}
    if salt is not None:
        extra["cache_salt"] = salt
    started = time.monotonic()
    last = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
                result.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                result.text += chunk.choices[0].delta.content
                now = time.monotonic()
                if last is None:
                    result.ttft_s = now - started
                else:
                    result.gaps_s.append(now - last)
                last = now
    except Exception as exc:  # a failed call is a result: counted, reported
        result.error = f"{type(exc).__name__}: {exc}"
    result.duration_s = time.monotonic() - started
    return result


async def replay(
    base_urls: list[str],
    sessions: list[Session],
    concurrency: int,
    max_tokens: int,
    turns: bool = False,
    salt: str | None = None,
) -> tuple[list, float]:
    """Every session's calls in order, call i through gateway i mod len(base_urls); with `turns`, as a conversation
    that carries the mesh's replies (`next_turn`); `salt`: every call's `cache_salt`."""
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600) for url in base_urls]
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    results: list[CallResult] = []
    progress = tqdm(total=sum(len(s.inputs) for s in sessions), desc="calls", leave=False)

    async def worker() -> None:
        while not queue.empty():
            session = queue.get_nowait()
            messages: list[dict[str, str]] = []
            previous: str | None = None  # the last input whose reply the conversation can carry
            reply = ""
            for index, text in enumerate(session.inputs):
                messages = next_turn(messages, previous, reply, text)
                result = await one_call(clients[index % len(clients)], session.name, messages, max_tokens, salt)
                results.append(result)
                previous, reply = (text if turns and result.error is None else None), result.text
                progress.update()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    progress.close()
    for client in clients:
        await client.close()
    return results, time.monotonic() - started


def scrape(metrics_url: str, prefix: str) -> dict[str, float]:
    """Totals, sums and counts of a process's metrics (labels summed), named without `prefix`."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name.endswith(("_total", "_sum", "_count")) and not sample.labels.get("le"):
                name = sample.name.removeprefix(prefix).removesuffix("_total")
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def mesh_counters(mesh: Mesh) -> dict[str, float]:
    """The gateways' counters (summed), and the decode replica's as `decode.<name>`."""
    totals = {f"decode.{k}": v for k, v in scrape(mesh.child("decode-0").metrics, "v41mesh_decode_").items()}
    for url in mesh.base_urls:
        for name, value in scrape(url + "/metrics", "v41mesh_gateway_").items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(results: list[CallResult], wall_s: float, counters: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tpots = [(r.duration_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
             if r.ttft_s is not None and r.completion_tokens > 1]  # fmt: skip
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    proposed = counters.get("dspark_draft_tokens_proposed", 0.0)
    steps = counters.get("decode_messages", 0.0)
    return {
        "calls": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "tpot_mean_s": float(np.mean(tpots)) if tpots else None,
        "output_tokens": completion,
        "output_tokens_per_s": completion / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "bounded_replays": counters.get("bounded_replays", 0.0),
        "writeback_waits": counters.get("writeback_waits", 0.0),
        "writeback_wait_mean_s": mean(counters, "writeback_wait_seconds"),
        "fallbacks": counters.get("fallbacks", 0.0),
        "retries": counters.get("retries", 0.0),
        "prefill_mean_s": mean(counters, "prefill_seconds"),
        "dspark_acceptance": counters.get("dspark_draft_tokens_accepted", 0.0) / proposed if proposed else None,
        "tokens_per_decode_step": counters.get("completion_tokens", 0.0) / steps if steps else None,
        # Decode's share of a TTFT: waiting to be taken in, then the join (restore + decoder bounded replay).
        "admit_wait_mean_s": mean(counters, "decode.admit_wait_seconds"),
        "join_mean_s": mean(counters, "decode.join_seconds"),
        "prompts_per_join": mean(counters, "decode.join_size"),
        "join_s_per_prompt": counters["decode.join_seconds_sum"] / counters["decode.join_size_sum"]
        if counters.get("decode.join_size_sum")
        else None,
        "step_mean_s": mean(counters, "decode.step_seconds"),
    }


def mean(counters: dict[str, float], histogram: str) -> float | None:
    count = counters.get(histogram + "_count")
    return counters[histogram + "_sum"] / count if count else None


def open_mesh(name: str, args: argparse.Namespace, data_dir: Path) -> Mesh:
    """A configuration's mesh, started and warmed by one call through each gateway (stopped by the caller)."""
    config = CONFIGS[name]
    spec = MeshSpec(
        model=args.model,
        data_dir=data_dir,
        gateway_replicas=config.gateways,
        gateway_args=["--stall-timeout-s", "600", *config.gateway_args],
        decode_args=config.decode_args,
    )
    mesh = Mesh(spec, on_event=lambda line: console.print(f"  [dim]{name}: {line}[/dim]"))
    mesh.start()
    try:
        warm_up = Session("warm-up", 0, ["Hello!"] * len(mesh.base_urls))
        warm = asyncio.run(replay(mesh.base_urls, [warm_up], 1, 2))[0]
        failed = [call.error for call in warm if call.error]
        if failed:
            raise RuntimeError(f"{name}: warm-up request failed: {failed[0]}")
    except BaseException:
        mesh.stop()
        raise
    return mesh


def run_round(mesh: Mesh, args: argparse.Namespace, sessions: list[Session], salt: str) -> dict[str, Any]:
    """Every session once through the mesh, under the round's cache salt: nothing reused from an earlier round."""
    before = mesh_counters(mesh)
    results, wall = asyncio.run(replay(mesh.base_urls, sessions, args.concurrency, args.max_tokens, args.turns, salt))
    after = mesh_counters(mesh)
    return summarise(results, wall, {k: v - before.get(k, 0.0) for k, v in after.items()})


def run_configs(configs: list[str], args: argparse.Namespace, sessions: list[Session]) -> dict[str, dict[str, Any]]:
    """Every configuration's mesh up at once, then `args.rounds` rounds, each replaying the sessions on every mesh
    in turn, in an order rotating by round (a machine whose load drifts weighs on all alike) → per configuration
    the rounds' medians, with every round kept (`rounds`)."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with contextlib.ExitStack() as stack:
        meshes = {}
        for name in configs:
            console.print(f"[bold]{name}[/bold]: starting a mesh")
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"serve-bench-{name}-")))
            meshes[name] = open_mesh(name, args, data_dir)
            stack.callback(meshes[name].stop)
        for r in range(args.rounds):
            for name in configs[r % len(configs) :] + configs[: r % len(configs)]:
                console.print(f"round {r + 1}/{args.rounds}: {name}")
                rounds[name].append(run_round(meshes[name], args, sessions, f"serve-bench-round-{r}"))
    return {name: {**medians(found), "rounds": found} for name, found in rounds.items()}


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (a list-valued one: the first round's), the spread of tokens/s and TTFT."""
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        values = [r[key] for r in rounds if r[key] is not None]
        numeric = isinstance(value, int | float) or value is None
        out[key] = (float(np.median(values)) if values else None) if numeric else value
    for key in ("output_tokens_per_s", "ttft_p50_s"):
        values = [r[key] for r in rounds if r[key] is not None]
        out[key + "_spread"] = [min(values), max(values)] if values else None
    return out


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def spread(bounds: list[float] | None, shown: Any) -> str:
    return "" if bounds is None else f" ({shown(bounds[0])}–{shown(bounds[1])})"


def config_table(title: str, *columns: str) -> Table:
    """A table with one row per configuration, its name in full."""
    table = Table(title=title)
    table.add_column("config", justify="right", min_width=max(map(len, CONFIGS)))
    for column in columns:
        table.add_column(column, justify="right")
    return table


def show(summary: dict[str, dict[str, Any]], ratios: dict[str, float | None]) -> None:
    table = config_table("serving: agent traces through the gateway", "calls", "errors", "TTFT p50 ms", "TTFT p99 ms",
                         "prefill ms", "ITL p50 ms", "ITL p99 ms", "TPOT ms", "out tok/s", "cached share",
                         "bounded replays", "write-back waits", "wait ms", "DSpark accept", "tok/step")  # fmt: skip
    for name, s in summary.items():
        accept = s["dspark_acceptance"]
        step = s["tokens_per_decode_step"]
        table.add_row(
            name, f"{s['calls']:.0f}", f"{s['errors']:.0f}", ms(s["ttft_p50_s"]) + spread(s["ttft_p50_s_spread"], ms),
            ms(s["ttft_p99_s"]), ms(s["prefill_mean_s"]), ms(s["itl_p50_s"]), ms(s["itl_p99_s"]), ms(s["tpot_mean_s"]),
            f"{s['output_tokens_per_s']:.1f}" + spread(s["output_tokens_per_s_spread"], lambda v: f"{v:.1f}"),
            f"{s['cached_share']:.1%}",
            f"{s['bounded_replays']:.0f}", f"{s['writeback_waits']:.0f}", ms(s["writeback_wait_mean_s"]),
            "–" if accept is None else f"{accept:.1%}",
            "–" if step is None else f"{step:.2f}",
        )  # fmt: skip
    console.print(table)
    table = config_table("decode's share of a TTFT (means)", "admit wait ms", "join ms", "prompts / join",
                         "join ms / prompt", "step ms")  # fmt: skip
    for name, s in summary.items():
        size = s["prompts_per_join"]
        table.add_row(
            name, ms(s["admit_wait_mean_s"]), ms(s["join_mean_s"]), "–" if size is None else f"{size:.2f}",
            ms(s["join_s_per_prompt"]), ms(s["step_mean_s"]),
        )  # fmt: skip
    console.print(table)
    for label, value in ratios.items():
        console.print(f"{label}: " + ("–" if value is None else f"[bold]{value:.2f}×[/bold]"))


def machine() -> dict[str, Any]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, small or a checkpoint directory")
    parser.add_argument("--traces", type=Path, default=TRACES, help="the folder of the datasets' session files")
    parser.add_argument("--datasets", default="miniswe,taubench")
    parser.add_argument("--sessions", type=int, default=6, help="sessions per dataset (the earliest ones)")
    parser.add_argument("--calls", type=int, default=12, help="calls per session at most")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="sessions replayed at once")
    parser.add_argument("--context", type=int, default=4096, help="the model's context (cuts sessions that exceed it)")
    parser.add_argument("--turns", action="store_true", help="replay sessions as conversations carrying the replies")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=3, help="replays of the sessions per configuration, alternated")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/serve_bench.json")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")

    # With --turns a prompt also carries the earlier replies: room for each, and its turn's template tokens.
    replies = args.calls * (args.max_tokens + TURN_TEMPLATE_TOKENS) if args.turns else 0
    sessions, skipped = load_sessions(
        args.traces, args.datasets.split(","), args.sessions, args.calls, args.context - args.max_tokens - replies
    )
    calls = sum(len(s.inputs) for s in sessions)
    console.print(f"{len(sessions)} sessions, {calls} calls ({skipped} cut: longer than the context), "
                  f"{args.concurrency} sessions at once, max_tokens {args.max_tokens}, model {args.model}"
                  f"{', as conversations (--turns)' if args.turns else ''}")  # fmt: skip
    summary = run_configs(configs, args, sessions)

    def ratio(numerator: str, denominator: str, key: str) -> float | None:
        a, b = summary.get(numerator, {}).get(key), summary.get(denominator, {}).get(key)
        return a / b if a and b else None

    ratios = {
        "TTFT p50, no-reuse / ours (target ≥ 4×)": ratio("no-reuse", "ours", "ttft_p50_s"),
        "output tokens/s, ours / no-dspark": ratio("ours", "no-dspark", "output_tokens_per_s"),
        "two-gateways TTFT p50 / ours": ratio("two-gateways", "ours", "ttft_p50_s"),
    }
    show(summary, ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "sessions": len(sessions),
              "calls": calls, "skipped_calls": skipped, "results": summary, "ratios": ratios}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
