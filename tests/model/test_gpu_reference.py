"""On a GPU (skipped without one): the demo checkpoint decoded through the GPU path — bf16, Triton kernels, the Engram
tables in host memory (a served GPU model's default placement), captured step graphs, with and without batch
invariance, the graphs captured on first use or ahead at start-up as the engine does (`DecodeBatch.capture`) —
follows the float32 torch reference on the CPU as closely as the same bf16 model does through the torch forms on the
CPU.

Every side joins the same held-out prompts (`train.eval.chat_prompts`) and steps over the reference's own greedy tokens
(teacher-forced, so one early near-tie cannot make the rest of the comparison moot). bf16 alone moves this model's
logits by ≈ 0.1–0.6 RMS (up to 3 at a single entry), so a bound on the GPU's logits by themselves would be loose or
flaky; the GPU's RMS deviation from the reference must stay within `SLACK` × the torch bf16 path's, its top tokens
must agree with the reference's at `AGREEMENT` of the positions, and where they differ the reference's own top-two
gap must be under `NEAR` (a near-tie that rounding may flip): a wrong kernel moves logits by whole units everywhere.

Batch invariance is process-wide, so each setting runs this file as a script in a fresh process
(`python tests/model/test_gpu_reference.py [--invariant]`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "model" / "checkpoints" / "v41-demo"
STEPS = 24
NEAR = 2.0  # logits: a reference top-two gap that bf16 rounding may flip (its largest single-entry move is ≈ 3)
AGREEMENT = 0.9  # share of positions whose top token must be the reference's exactly
SLACK = 1.5  # the GPU path's RMS deviation over the torch bf16 path's (measured: 1.08–1.10)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("invariant", [False, True], ids=["variant", "invariant"])
def test_gpu_greedy_decoding_follows_the_cpu_reference(invariant: bool) -> None:
    done = subprocess.run(
        [sys.executable, __file__, *(["--invariant"] if invariant else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


# ------------------------------------------------------------------------------------------- the script


def _forced(
    device: str, dtype: str, prompts: list[list[int]], tokens: list[list[int]] | None, start_up: bool = False
) -> list[Tensor]:
    """Logits [B, V] (float32, on the CPU, rows in prompt order) of the join and of each step: over `tokens` when
    given, else over each step's own argmax (the reference's greedy decoding). `start_up`: the graphs captured
    before the first join."""
    from model import DecodeBatch, encode_prefill
    from model_service.runtime import load_model

    model = load_model(str(DEMO), "full", device=device, dtype=dtype)
    batch = DecodeBatch(model, len(prompts), graphs=device == "cuda")
    if start_up:
        batch.capture()
    with torch.no_grad():
        joined = batch.join_many([(p.blocks, p.encoder_state) for p in (encode_prefill(model, q) for q in prompts)])
        row = [batch.seq_ids.index(seq) for seq, _ in joined]  # the batch orders its rows by replay length
        logits = [torch.stack([first for _, first in joined]).float().cpu()]
        for j in range(STEPS):
            fed = [t[j] for t in tokens] if tokens else logits[-1].argmax(-1).tolist()
            in_rows = [fed[row.index(r)] for r in range(len(prompts))]
            logits.append(batch.decode_step(in_rows).float().cpu()[row])
    return logits


def _rms(reference: list[Tensor], other: list[Tensor]) -> float:
    return float(torch.stack([(w - g).pow(2).mean() for w, g in zip(reference, other, strict=True)]).mean().sqrt())


def _deviations(reference: list[Tensor], torch_bf16: list[Tensor], gpu: list[Tensor]) -> list[str]:
    """What the GPU's logits do wrong against the reference (nothing: []), and its figures."""
    same, far = 0, []
    for j, (want, got) in enumerate(zip(reference, gpu, strict=True)):
        for b, (w, g) in enumerate(zip(want, got, strict=True)):
            top, chosen = int(w.argmax()), int(g.argmax())
            same += top == chosen
            gap = float(w[top] - w[chosen])
            if gap > NEAR:
                far.append(f"row {b} position {j}: reference {top}, GPU {chosen} ({gap:.2f} below it in the reference)")
    positions = len(reference) * len(reference[0])
    deviation = {"GPU": _rms(reference, gpu), "torch bf16": _rms(reference, torch_bf16)}
    print(f"  top tokens agree at {same} of {positions} positions; RMS deviation from the reference {deviation}")
    if same < AGREEMENT * positions:
        far.append(f"top tokens agree at {same} of {positions} positions only")
    if deviation["GPU"] > SLACK * deviation["torch bf16"]:
        far.append(f"RMS deviation {deviation['GPU']:.3f} over {SLACK} × the torch bf16 path's")
    return far


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--invariant", action="store_true", help="batch invariance on, as the decode service runs")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from model import kernels
    from train.eval import chat_prompts

    kernels.set_batch_invariant(args.invariant)
    prompts = chat_prompts(0, 4)
    reference = _forced("cpu", "float32", prompts, None)
    tokens = [[int(t) for t in column] for column in zip(*(step.argmax(-1) for step in reference), strict=True)]
    torch_bf16 = _forced("cpu", "bfloat16", prompts, tokens)
    errors = []
    for start_up in (False, True):
        print(f"batch invariance {'on' if args.invariant else 'off'}, graphs captured "
              f"{'at start-up' if start_up else 'on first use'}:")  # fmt: skip
        found = _deviations(reference, torch_bf16, _forced("cuda", "bfloat16", prompts, tokens, start_up))
        errors += [f"start-up capture {start_up}: {e}" for e in found]
    print("\n".join(errors[:30]) or "equal to the reference within bf16's reach")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
