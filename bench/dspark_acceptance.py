"""DSpark's accepted drafts per verify at temperature 1: keyed noise (draft and target raced on the same (seed,
position) noise, as the decode service samples) against drafts sampled independently and tested by min(1, p/q), with
greedy decoding beside them.

    python bench/dspark_acceptance.py [--model model/checkpoints/v41-demo] [--prompts 32] [--width 4] [--tokens 96]

Each held-out prompt (train.eval) is prefilled and decoded alone by draft + verify of `width` drafts until `tokens`
tokens or the end of sequence; per mode it reports the mean drafts accepted per verify with its standard error and
the counts of each. Accepted lengths depend on the model, not the device: this runs on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decode_svc.sampler import StepSampling  # noqa: E402
from mesh.up import DEFAULT_MODEL  # noqa: E402
from model import DecodeBatch, SamplingParams, Transformer, encode_prefill  # noqa: E402
from model_service.runtime import load_model  # noqa: E402
from train.eval import chat_prompts  # noqa: E402

MODES = ("keyed", "independent", "greedy")


def sampling(mode: str, seed: int, cursor: int) -> SamplingParams:
    """A forward's sampling at output index `cursor`: keyed on (seed, position), or plain T = 1, or greedy."""
    if mode == "independent":
        return SamplingParams.uniform(1, 1.0)
    temperature, off = torch.tensor([0.0 if mode == "greedy" else 1.0]), torch.tensor([0])
    return StepSampling(temperature, off, torch.tensor([1.0]), torch.tensor([seed]), torch.tensor([cursor]))


def accepted(model: Transformer, prompt: list[int], mode: str, seed: int, width: int, tokens: int) -> list[int]:
    """Drafts accepted by each verify of one prompt's decode."""
    batch = DecodeBatch(model)
    out = encode_prefill(model, prompt)
    _, logits = batch.join(out.blocks, out.encoder_state)
    generator = torch.Generator().manual_seed(seed)
    y, n, counts = int(logits.float().argmax()), 1, []
    while n < tokens and y != model.args.eos_token_id:
        draft = batch.dspark_draft([y], sampling(mode, seed, n), generator)
        result = batch.verify([y], draft.trim(width), sampling(mode, seed, n), torch.tensor([width]), generator)
        counts.append(int(result.accepted[0]))
        n, y = n + len(result.tokens[0]), result.tokens[0][-1]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-seed", type=int, default=7, help="which held-out conversations (train.eval)")
    parser.add_argument("--width", type=int, default=4, help="drafts verified per step")
    parser.add_argument("--tokens", type=int, default=96, help="tokens decoded per prompt at most")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/dspark_acceptance.json")
    ns = parser.parse_args()
    model = load_model(ns.model, "full", device="cpu")
    prompts = chat_prompts(ns.prompt_seed, ns.prompts)
    rows = []
    for mode in ns.modes.split(","):
        counts = [c for i, p in enumerate(prompts) for c in accepted(model, p, mode, 1000 + i, ns.width, ns.tokens)]
        mean, sd = statistics.mean(counts), statistics.stdev(counts)
        row = {"mode": mode, "verifies": len(counts), "mean_accepted": round(mean, 3),
               "standard_error": round(sd / len(counts) ** 0.5, 3),
               "counts": dict(sorted(collections.Counter(counts).items()))}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"model": ns.model, "prompts": ns.prompts, "width": ns.width, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
