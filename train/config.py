"""The training run's one typed configuration (flags > TRAIN_* environment > defaults, via mesh.config)."""

from __future__ import annotations

from pathlib import Path

import msgspec


class TrainConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Train the demo checkpoint: backbone, QAT, a no-QAT twin, DSpark, confidence calibration.

    out: checkpoint directory written at the end (config.json, safetensors shards, tokenizer reference)
    work_dir: resumable state, the twin and logs (default: OUT.work)
    preset: model preset or config.json to train
    init: continue from this checkpoint directory instead of seeded weights
    mix: share of training batches of each kind (chat, tool, json, text)
    dspark_mix: share of DSpark batches of each conversation kind (chat, tool, json); the default is `mix`'s
    seed: seed of the weights and of the data stream
    device: cuda, cpu or auto
    minutes: wall-clock budget of the training phases; a phase with steps 0 runs for its share of it
    base_share: share of the budget for the backbone (bf16 main KV)
    qat_share: share for QAT (FP4 main KV, stored-format weights); the twin runs as many steps without FP4 KV
    dspark_share: share for DSpark
    base_steps: backbone steps (0: by time)
    qat_steps: QAT steps (0: by time)
    dspark_steps: DSpark steps (0: by time)
    batch_budget: tokens per batch (rows × padded length); ≤ 65,535 on a GPU (a kernel's grid), less if short of memory
    dspark_batch_budget: tokens per DSpark batch (likewise)
    draft_rows: at most this many draft rows (rows × anchors × block) per DSpark batch
    anchors: anchors per row of a DSpark batch
    max_len: longest training sequence
    lr: peak learning rate of the backbone
    qat_lr: peak learning rate of the QAT phase and the twin
    dspark_lr: peak learning rate of DSpark
    warmup: warm-up steps of every phase
    replay_share: share of conversation batches trained with a truncated decoder window (bounded replay)
    twin: also train the no-QAT twin for the QAT claim
    eval_every: steps between held-out evaluations
    heldout_tokens: tokens per held-out batch (two of text, two of tool conversations: the same sets in every run)
    save_every: steps between resumable saves
    workers: data-loader processes
    log_level: debug, info, warning or error
    """

    out: str = "runs/v41-demo"
    work_dir: str = ""
    preset: str = "demo"
    init: str = ""
    mix: tuple[float, float, float, float] = (0.20, 0.55, 0.10, 0.15)
    dspark_mix: tuple[float, float, float] = (0.20, 0.55, 0.10)
    seed: int = 0
    device: str = "auto"
    minutes: float = 7.0
    base_share: float = 0.60
    qat_share: float = 0.06
    dspark_share: float = 0.28
    base_steps: int = 0
    qat_steps: int = 0
    dspark_steps: int = 0
    batch_budget: int = 65280
    dspark_batch_budget: int = 32768
    draft_rows: int = 12288
    anchors: int = 48
    max_len: int = 768
    lr: float = 4e-3
    qat_lr: float = 1e-3
    dspark_lr: float = 3e-3
    warmup: int = 30
    replay_share: float = 0.25
    twin: bool = True
    eval_every: int = 50
    heldout_tokens: int = 8192
    save_every: int = 200
    workers: int = 4
    log_level: str = "info"

    def __post_init__(self) -> None:
        shares = (self.base_share, self.qat_share, self.dspark_share)
        if any(s < 0 for s in shares) or sum(shares) + (self.qat_share if self.twin else 0) > 1.0:
            raise msgspec.ValidationError("phase shares must be ≥ 0 and (with the twin) add up to at most 1")
        if any(w < 0 for w in self.mix) or sum(self.mix) <= 0:
            raise msgspec.ValidationError("mix must be four shares ≥ 0 (chat, tool, json, text), not all 0")
        if any(w < 0 for w in self.dspark_mix) or sum(self.dspark_mix) <= 0:
            raise msgspec.ValidationError("dspark_mix must be three shares ≥ 0 (chat, tool, json), not all 0")
        if self.minutes <= 0 or self.batch_budget < self.max_len or self.anchors < 1:
            raise msgspec.ValidationError("minutes must be > 0, batch_budget ≥ max_len and anchors ≥ 1")

    @property
    def work(self) -> Path:
        return Path(self.work_dir or f"{self.out}.work")
