"""The whole serving path and the dense forward at the precisions services run: bfloat16 (the GPU default) and float16.

A dtype mismatch (an fp32 tensor written into a bf16 buffer, a kernel fed the wrong dtype) shows up here on the CPU
instead of on the GPU at warm-up. The kernels run their torch references: both backends share the argument checks,
and tests/model/kernels runs the Triton kernels at these dtypes (this whole path through the interpreted kernels
takes about a minute on CPU, too long for CI). Accuracy is only sanity-checked: a random tiny model amplifies
rounding chaotically (its dense bf16 forward is itself at cosine 0.46–0.99 from the fp64 one, by input), so the bound
below catches a broken path (near 0), not a small loss.
"""

from __future__ import annotations

import pytest
import torch

from model import (
    DecodeBatch,
    EncoderState,
    Past,
    SamplingParams,
    Transformer,
    build_model,
    draft_logits,
    encode_prefill,
)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def low(request, tiny_args) -> Transformer:
    return build_model(tiny_args, seed=0, dtype=request.param)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_serving_path_runs_at_low_precision(low, tiny, tokens, seed):
    dtype, a = low.dtype, low.args
    W, Bt, g = a.sliding_window, a.kv_block_tokens, a.dspark_block_size
    prompt = Bt + W + 1  # a complete block, a partial one, and more than a window to replay
    ids = tokens(prompt + 1)

    out = encode_prefill(low, ids[:prompt], chunk_tokens=W)
    # The handoff record crosses processes as bytes: hidden rows at the model's precision, the pre-mix in fp32.
    state = EncoderState.from_bytes(out.encoder_state.to_bytes(), a, low.fingerprint)
    assert (state.hidden.dtype, state.hidden_pre.dtype, state.position) == (dtype, torch.float32, prompt)
    assert state.to_bytes() == out.encoder_state.to_bytes()

    batch = DecodeBatch(low)
    seq, first = batch.join(out.blocks, state)
    second = batch.decode_step(ids[prompt:])
    assert (first.dtype, second.dtype, second.shape) == (torch.float32, torch.float32, (1, a.vocab_size))
    with torch.no_grad():
        oracle = tiny(ids[None], replay_start=prompt - W)[0, prompt - 1 :]
        dense = low(ids[None], replay_start=prompt - W)[0, prompt - 1 :]
    served = torch.stack((first, second[0]))
    assert bool(served.isfinite().all())
    similarity, reachable = cosine(served, oracle), cosine(dense, oracle)
    print(f"{dtype}: cosine to the fp64 dense forward {similarity.tolist()}, its own dense {reachable.tolist()}")
    # 0.5, or within 0.2 of the dense forward at this precision where that is itself further from fp64.
    assert bool((similarity > (reachable - 0.2).clamp(max=0.5)).all())

    # DSpark draft + verification of two sampled rows, each with its own generator.
    other = batch.fork(seq)
    sampling = SamplingParams.uniform(2, temperature=1.0)
    generators = [torch.Generator().manual_seed(seed), None]
    pending = [int(second[0].argmax())] * 2
    draft = batch.dspark_draft(pending, sampling, generators)
    assert (draft.tokens.shape, draft.probs.dtype, draft.confidence.dtype) == ((2, g), torch.float32, torch.float32)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(2, g), rtol=0, atol=1e-4)
    assert bool(((draft.confidence > 0) & (draft.confidence < 1)).all())
    result = batch.verify(pending, draft, sampling, torch.tensor([g, 1]), generators)
    assert result.logits.dtype == torch.float32
    assert bool(result.logits.isfinite().all())
    assert batch.positions() == [prompt + 2 + int(n) for n in result.accepted]

    # Both leave; a second turn resumes from one's end-of-sequence record (restore at low precision).
    export, _ = batch.leave(seq), batch.leave(other)
    emitted = torch.tensor(pending[:1] + result.tokens[0][:-1])
    sequence = torch.cat((ids, emitted, tokens(3)))
    warm = encode_prefill(low, sequence, Past(out.blocks + export.blocks, export.encoder_state))
    assert warm.swa_restored
    assert warm.resumed_at == export.encoder_state.position


def test_dense_forward_runs_at_low_precision(low, tokens):
    """The training forms: logits with the DSpark taps, and the teacher-forced DSpark forward, with gradients."""
    a = low.args
    ids = tokens(a.sliding_window + a.dspark_block_size + 3)[None]
    logits, taps = low(ids, return_taps=True)
    assert (logits.dtype, taps.dtype) == (torch.float32, low.dtype)
    drafted, confidence = draft_logits(low, ids, taps, torch.tensor([1, a.sliding_window]))
    assert (drafted.dtype, confidence.dtype) == (torch.float32, torch.float32)
    assert all(bool(t.isfinite().all()) for t in (logits, drafted, confidence))
    (drafted.logsumexp(-1).mean() + confidence.mean()).backward()
    grad = low.mtp[-1].confidence_head.proj.weight.grad
    assert grad is not None
    assert grad.dtype == low.dtype
    assert bool(grad.isfinite().all())
    low.zero_grad(set_to_none=True)
