"""What grammar-constrained decoding costs: the token masks per decode step, with and without DSpark, and the
compile time of the structured-output tests' JSON Schemas.

    python bench/constraint_bench.py [--model model/checkpoints/v41-demo] [--device cpu|cuda] [--batches 1,64]
        [--steps 24] [--rounds 3] [--fill-threads 0] [--schemas 52] [--out bench/out/constraint_bench.json]

The model decodes B rows of a JSON-mode prompt (a DecodeBatch, no services), every row under the same compiled JSON
Schema (an object holding an unbounded array of strings, so the grammar stays open; a row whose grammar completes
starts a fresh guide, outside the clock). Per step, `plain`: one decode_step, the masks (decode_svc.masking: fill
the rows' bitmasks on the host, apply them where the logits are), greedy sampling, the guides following the tokens;
`dspark`: one DSpark draft of γ tokens (its first link masked), the grammar's judgement of it (`admitted`: each
row's drafts up to the first its guide refuses), one verify over the admitted drafts with their masks. The masks'
share is the time spent in the guides and Masks.apply (the device synchronised around each), against the whole
step (also synchronised); its parts are the bitmasks filled on the host, their copy and application, and the guides
following the tokens (and judging the drafts). Those synchronisations also keep the verify's fill from overlapping
its forward on a GPU, so the masked step runs once more unclocked, as served, and `added` is its excess over the
free step, as a share of it. Each round runs the free step, then for each count of mask fill threads
(`--fill-threads`, decode_svc.masking.set_fill_threads) the masked step clocked and as served; figures are medians
over the rounds, `added` with its range. `accepted` is the drafts accepted per row and DSpark step, with and without
the constraint. Compile: each schema compiled once by decode_svc.grammar (no cache), strict every other one, against
the served tokenizer's 129,280-id vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas import schemas  # noqa: E402
from serve_bench import machine  # noqa: E402

from decode_svc.grammar import Grammars, default_tokenizer, vocabulary  # noqa: E402
from decode_svc.guide import Guide  # noqa: E402
from decode_svc.masking import Masks, admitted, set_fill_threads  # noqa: E402
from decode_svc.sampler import StepSampling  # noqa: E402
from mesh.up import DEFAULT_MODEL  # noqa: E402
from model import DecodeBatch, PrefillOutput, encode_prefill  # noqa: E402
from model_service.runtime import load_model  # noqa: E402
from proto.decode.v1 import decode_pb2  # noqa: E402
from recipe import Conversation, ModelVersion, ResponseFormat, User, load_tokenizer, render  # noqa: E402

OPEN_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}
console = Console(width=140)


class Clock:
    """Seconds spent in timed sections, the device synchronised at both ends of each; a clock that is not `running`
    times nothing and never synchronises (the masked steps whose masks overlap the forwards as served)."""

    def __init__(self, device: torch.device, running: bool = True) -> None:
        self.device = device
        self.running = running
        self.seconds = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def timed(self) -> Iterator[None]:
        if not self.running:
            yield
            return
        self.sync()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds += time.perf_counter() - started


class Clocks(NamedTuple):
    """What a masked step spends on its constraint, in three parts: the bitmasks filled on the host (`fill`), their
    copy and application where the logits are (`apply`), the guides taking the emitted tokens and judging the drafts
    (`follow`)."""

    fill: Clock
    apply: Clock
    follow: Clock

    @classmethod
    def on(cls, device: torch.device, running: bool) -> Clocks:
        return cls(*(Clock(device, running) for _ in cls._fields))


class TimedMasks(Masks):
    """Masks whose every call is clocked: the fill apart from the rest of the apply."""

    def __init__(self, clocks: Clocks, guides: list[Guide | None], drafts: list[list[int]] | None = None) -> None:
        super().__init__(guides, drafts)
        self.clocks = clocks

    def apply(self, logits: torch.Tensor) -> None:
        with self.clocks.apply.timed():
            super().apply(logits)

    def fill(self, T: int, vocab: int, pinned: bool) -> tuple[torch.Tensor, list[int]]:
        with self.clocks.fill.timed():
            return super().fill(T, vocab, pinned)


def greedy(batch: int, masks: Masks | None) -> StepSampling:
    zeros = torch.zeros(batch)
    return StepSampling(zeros, zeros.long(), torch.ones(batch), masks=masks)


class Rows:
    """B rows of one prompt joined to a DecodeBatch (`leave` takes them out: the batch and its captured graphs serve
    every measurement of that batch size), their pending tokens and (when constrained) their guides."""

    def __init__(self, batch: DecodeBatch, prompt: PrefillOutput, rows: int, grammar: Any | None) -> None:
        self.batch = batch
        joined = batch.join_many([(prompt.blocks, prompt.encoder_state)] * rows)
        self.seq_ids = [seq_id for seq_id, _ in joined]
        self.pending = [int(logits.argmax()) for _, logits in joined]
        self.grammar = grammar
        self.guides: list[Guide | None] = [self._guide() for _ in range(rows)]
        self.follow([[t] for t in self.pending])

    def leave(self) -> None:
        for seq_id in self.seq_ids:
            self.batch.leave(seq_id)

    def _guide(self) -> Guide | None:
        return Guide(self.grammar, banned=[128825], stop_ids=[1]) if self.grammar is not None else None

    def follow(self, emitted: list[list[int]]) -> None:
        """Every guide follows its row's emitted tokens (as the engine does: its matcher takes them in the next
        step's fill); a grammar that refuses one (it is complete) starts again."""
        for b, tokens in enumerate(emitted):
            for token in tokens:
                guide = self.guides[b]
                if guide is not None and not guide.follow(token):
                    self.guides[b] = self._guide()

    def masks(self, clocks: Clocks, drafts: list[list[int]] | None = None) -> Masks | None:
        return TimedMasks(clocks, self.guides, drafts) if self.grammar is not None else None


def plain_step(rows: Rows, clocks: Clocks) -> int:
    logits = rows.batch.decode_step(rows.pending)
    rows.pending = greedy(len(rows.pending), rows.masks(clocks)).probs(logits).argmax(-1).tolist()
    with clocks.follow.timed():
        rows.follow([[t] for t in rows.pending])
    return 0


def dspark_step(rows: Rows, clocks: Clocks) -> int:
    """One DSpark step; returns the drafts accepted."""
    draft = rows.batch.dspark_draft(rows.pending, greedy(len(rows.pending), rows.masks(clocks)))
    drafts = draft.tokens.tolist()
    if rows.grammar is not None:
        with clocks.follow.timed():
            taken = admitted(rows.guides, drafts)
        drafts = [row[:n] for row, n in zip(drafts, taken, strict=True)]
    lengths = torch.tensor([len(row) for row in drafts])
    result = rows.batch.verify(rows.pending, draft, greedy(len(rows.pending), rows.masks(clocks, drafts)), lengths)
    rows.pending = [tokens[-1] for tokens in result.tokens]
    with clocks.follow.timed():
        rows.follow(result.tokens)
    return int(result.accepted.sum())


def measure(
    batch: DecodeBatch,
    prompt: PrefillOutput,
    rows: int,
    grammar: Any | None,
    mode: str,
    steps: int,
    clocked: bool = True,
) -> dict:
    """Median milliseconds over `steps` steps (after two unmeasured ones) of the step and of the constraint's parts
    (`Clocks`: `apply` without the fill inside it; `mask` all three); `clocked`: the parts timed."""
    started = time.perf_counter()
    lanes = Rows(batch, prompt, rows, grammar)
    step = plain_step if mode == "plain" else dspark_step
    totals, parts, accepted = [], defaultdict(list), 0
    for i in range(steps + 2):
        clocks, whole = Clocks.on(batch.model.device, clocked), Clock(batch.model.device)
        with whole.timed():
            taken = step(lanes, clocks)
        if i >= 2:
            totals.append(whole.seconds * 1e3)
            fill, follow = clocks.fill.seconds * 1e3, clocks.follow.seconds * 1e3
            apply = clocks.apply.seconds * 1e3 - fill
            for name, ms in (("fill", fill), ("apply", apply), ("follow", follow), ("mask", fill + apply + follow)):
                parts[name].append(ms)
            accepted += taken
    lanes.leave()
    kind = "free" if grammar is None else "masked" if clocked else "masked, unclocked"
    console.log(f"batch {rows} {mode} {kind}: {time.perf_counter() - started:.1f} s")
    medians = {f"{name}_ms": statistics.median(ms) for name, ms in parts.items()}
    return {"step_ms": statistics.median(totals), **medians, "accepted_per_row_step": accepted / (steps * rows)}


def compare(
    decode: DecodeBatch,
    prompt: PrefillOutput,
    rows: int,
    grammar: Any,
    mode: str,
    steps: int,
    rounds: int,
    threads: list[int],
) -> list[dict[str, Any]]:
    """`rounds` rounds of the free step, then for each count of fill threads the masked step clocked and as served;
    per count, the medians over the rounds and the range of the share added."""
    counts = list(dict.fromkeys(set_fill_threads(n) for n in threads))  # 0 as the count it stands for, once
    free: list[dict] = []
    runs: dict[int, list[tuple[dict, dict]]] = defaultdict(list)
    for _ in range(rounds):
        free.append(measure(decode, prompt, rows, None, mode, steps))
        for n in counts:
            set_fill_threads(n)
            runs[n].append((measure(decode, prompt, rows, grammar, mode, steps),
                            measure(decode, prompt, rows, grammar, mode, steps, clocked=False)))  # fmt: skip
    set_fill_threads(0)

    def median(key: str, of: list[dict]) -> float:
        return statistics.median(m[key] for m in of)

    out = []
    for n, pairs in runs.items():
        masked, served = [m for m, _ in pairs], [s for _, s in pairs]
        added = [(s["step_ms"] - f["step_ms"]) / s["step_ms"] for f, s in zip(free, served, strict=True)]
        out.append({"batch": rows, "mode": mode, "fill_threads": n, "free_step_ms": median("step_ms", free),
                    "masked_step_ms": median("step_ms", masked), "mask_ms": median("mask_ms", masked),
                    "fill_ms": median("fill_ms", masked), "apply_ms": median("apply_ms", masked),
                    "follow_ms": median("follow_ms", masked),
                    "mask_share": median("mask_ms", masked) / median("step_ms", masked),
                    "served_step_ms": median("step_ms", served), "added_share": statistics.median(added),
                    "added_min": min(added), "added_max": max(added),
                    "free_accepted": median("accepted_per_row_step", free),
                    "masked_accepted": median("accepted_per_row_step", masked)})  # fmt: skip
    return out


def compile_times(grammars: Grammars, count: int) -> list[float]:
    out = []
    for schema, strict in schemas(count):
        started = time.perf_counter()
        grammars.compile_now(decode_pb2.OutputConstraint(json_schema=json.dumps(schema), strict=strict))
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="tiny, small or a checkpoint directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating the free and masked steps")
    parser.add_argument("--fill-threads", default="0", help="mask fill threads to compare (0: half the cores)")
    parser.add_argument("--schemas", type=int, default=52, help="JSON Schemas compiled (bench/schemas.py)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/constraint_bench.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, "full", device=args.device)
    grammars = Grammars(vocabulary(default_tokenizer(), model.args.vocab_size))
    grammar = grammars.compile_now(decode_pb2.OutputConstraint(json_schema=json.dumps(OPEN_SCHEMA)))
    conversation = Conversation([User("List some colours as JSON.")], thinking=False)
    conversation.response_format = ResponseFormat("json_schema", schema=OPEN_SCHEMA)
    prompt = render(conversation, ModelVersion.V41, load_tokenizer()).token_ids or []

    results: list[dict[str, Any]] = []
    prefill = encode_prefill(model, prompt, None)
    threads = [int(t) for t in args.fill_threads.split(",")]
    for batch in (int(b) for b in args.batches.split(",")):
        decode = DecodeBatch(model, capacity=batch)
        for mode in ("plain", "dspark"):
            for r in compare(decode, prefill, batch, grammar, mode, args.steps, args.rounds, threads):
                results.append(r)  # logged at once: a run cut short still shows what it measured
                console.log(
                    f"batch {batch} {mode}, {r['fill_threads']} fill threads: free {r['free_step_ms']:.2f} ms, "
                    f"masked as served {r['served_step_ms']:.2f} ms ({r['added_share']:.1%} added, "
                    f"{r['added_min']:.1%} – {r['added_max']:.1%}), fill {r['fill_ms']:.2f} ms"
                )
    seconds = compile_times(grammars, args.schemas)

    title = f"token masks per decode step ({args.model}, {model.device}; medians of {args.rounds} × {args.steps} steps)"
    table = Table(title=title)
    columns = (
        "batch",
        "step",
        "fill threads",
        "step, free (ms)",
        "step, masked (ms)",
        "masks (ms)",
        "fill, apply, follow (ms)",
        "masks / step",
        "masked, unclocked (ms)",
        "added / step",
        "accepted, free",
        "accepted, masked",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        parts = f"{r['fill_ms']:.2f}, {r['apply_ms']:.2f}, {r['follow_ms']:.2f}"
        figures = (f"{r['free_step_ms']:.2f}", f"{r['masked_step_ms']:.2f}", f"{r['mask_ms']:.3f}", parts,
                   f"{r['mask_share']:.1%}", f"{r['served_step_ms']:.2f}",
                   f"{r['added_share']:.1%} ({r['added_min']:.1%} – {r['added_max']:.1%})",
                   f"{r['free_accepted']:.2f}", f"{r['masked_accepted']:.2f}")  # fmt: skip
        table.add_row(str(r["batch"]), r["mode"], str(r["fill_threads"]), *figures)
    console.print(table)
    ms = sorted(s * 1e3 for s in seconds)
    compile_summary = {"schemas": len(ms), "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                       "max_ms": ms[-1], "total_s": sum(seconds)}  # fmt: skip
    console.print(f"compile of {len(ms)} JSON Schemas: median {compile_summary['median_ms']:.0f} ms, p90 "
                  f"{compile_summary['p90_ms']:.0f} ms, max {compile_summary['max_ms']:.0f} ms")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "steps": results,
              "compile": compile_summary, "compile_ms": [s * 1e3 for s in seconds]}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
