"""Sequential Temperature Scaling of DSpark's confidence head (reference §4.4).

The decode engine keeps drafts while the running product a_k = Π_{i≤k} c_i stays high, so what must be calibrated
is a_k as the probability that drafts 1…k are all accepted. With one temperature per draft position,
c_i = σ(z_i / T_i), the T_k are fitted in order: T_1 minimises the expected calibration error (ECE) of a_1, then
T_2 that of a_2 with T_1 fixed, and so on, each by a grid search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GRID = torch.logspace(-1, 1, 81)  # temperatures 0.1 … 10
BINS = 10


def ece(predicted: Tensor, observed: Tensor, bins: int = BINS) -> float:
    """Expected calibration error with equal-width bins: Σ_b (n_b / n) · |mean predicted − mean observed|."""
    if predicted.numel() == 0:
        return float("nan")
    index = (predicted * bins).long().clamp(0, bins - 1)
    p = torch.zeros(bins).index_add_(0, index, predicted)
    o = torch.zeros(bins).index_add_(0, index, observed.float())
    return float(((p - o).abs()).sum() / predicted.numel())


@dataclass(frozen=True)
class Calibration:
    temperatures: list[float]  # T_k, k = 1…γ
    ece_before: list[float]  # ECE of the running product a_k at T = 1
    ece_after: list[float]  # … at the fitted temperatures


def running_product(logits: Tensor, temperatures: Tensor) -> Tensor:
    """a [N, γ]: a_k = Π_{i≤k} σ(z_i / T_i)."""
    return torch.sigmoid(logits / temperatures).cumprod(-1)


def sequential_temperature_scaling(logits: Tensor, accepted: Tensor, valid: Tensor) -> Calibration:
    """Fit per-position temperatures.

    logits [N, γ]: confidence logits; accepted [N, γ]: draft k accepted given drafts < k were; valid [N, γ]: the
    draft position exists. Row n counts for position k when valid[n, k].
    """
    logits, accepted, valid = logits.float().cpu(), accepted.cpu(), valid.cpu()
    g = logits.shape[1]
    all_accepted = accepted.long().cumprod(-1).bool()
    temperatures = torch.ones(g)
    before = [
        ece(running_product(logits, temperatures)[valid[:, k], k], all_accepted[valid[:, k], k]) for k in range(g)
    ]
    after = []
    for k in range(g):
        rows = valid[:, k]
        best = (float("inf"), 1.0)
        for t in GRID.tolist():
            temperatures[k] = t
            score = ece(running_product(logits[rows, : k + 1], temperatures[: k + 1])[:, k], all_accepted[rows, k])
            best = min(best, (score, t))
        temperatures[k] = best[1]
        after.append(best[0] if rows.any() else float("nan"))
    return Calibration([float(t) for t in temperatures], before, after)
