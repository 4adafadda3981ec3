"""On a GPU (skipped without one): masks applied to logits a forward is still computing — their bitmask copied on a
side stream while it runs — give exactly the masks applied on the host, step after step."""

from __future__ import annotations

import pytest
import torch

from decode_svc.guide import Guide
from decode_svc.masking import Masks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 4096


def busy_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits [rows, VOCAB] at the end of a few milliseconds of GEMMs still queued on the current stream."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, 2048, device="cuda", generator=g)
    w = torch.randn(2048, 2048, device="cuda", generator=g) / 2048**0.5
    for _ in range(40):
        x = torch.tanh(x @ w) * 2.0
    return x.repeat(1, VOCAB // 2048)


def test_masks_applied_beside_a_running_forward_equal_the_host_ones() -> None:
    torch.cuda.synchronize()
    results = []
    for step in range(30):
        gen = torch.Generator().manual_seed(step)
        guides = [
            Guide(None, banned=torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()) if n else None
            for n in torch.randint(0, 40, (8,), generator=gen)
        ]
        logits = busy_logits(len(guides), step)
        Masks(guides).apply(logits)  # the host fills while the GEMMs run; nothing waits for them here
        results.append((guides, logits))
    for guides, logits in results:
        want = torch.zeros(logits.shape)
        Masks(guides).apply(want)  # on the host
        on_device = logits.cpu()
        assert bool(torch.isinf(want).any())
        assert torch.equal(on_device == -torch.inf, torch.isinf(want))
        assert bool(on_device[~torch.isinf(want)].isfinite().all())
