"""The training phases of the demo checkpoint.

    base    the backbone from seeded weights: loss on assistant tokens (conversations) and on every text token;
            some conversation batches truncate the decoder window (bounded replay, reference §7.1)
    qat     continue with the released QAT on: FP4 main KV and stored-format (FP8 / FP4) weights
    twin    the same steps from the same `base`, main KV in bf16 (the no-QAT baseline of the paper's claim)
    dspark  DSpark against the frozen `qat` model (reference §4.4)
    calibrate  per-position temperatures of the confidence head (Sequential Temperature Scaling)

Every phase runs for a number of steps, or for its share of the time budget (the learning-rate schedule follows
whichever comes first). A phase saves its state every `save_every` steps and at its end under the work directory;
a rerun with the same directories continues where the last one stopped.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from model import ModelArgs, Transformer, build_model, load_checkpoint, preset
from model.moe import Gate
from train import calibrate, dspark, qat
from train.batches import CONVERSATION_KINDS, Batch, StepBatches, held_out_batches
from train.config import TrainConfig
from train.eval import heldout_losses
from train.export import export_checkpoint
from train.loss import learned_token_loss

BIAS_SPEED = 1e-3  # noaux_tc routing-bias update per step (reference §2.7)
MEMORY_SHARE = 0.8  # a phase's worst-case step may take this share of the GPU's memory (room for fragmentation)
# The largest batch trained on a GPU so far: model.kernels.candidate_mask had one program row per token on grid axis 1
# (CUDA caps it at 65,535). Its rows are on axis 0 now (d3eac91); lift this once a larger batch has run on a GPU.
MAX_BATCH_TOKENS = 65535


@dataclass
class PhaseResult:
    steps: int
    seconds: float
    last_loss: float
    heldout: dict[str, float]
    batch_tokens: int  # token budget per batch (rows × padded length)
    throughput: dict[str, float]


class Throughput:
    """Token slots (padding included) and learned tokens per second since the first batch was taken."""

    def __init__(self) -> None:
        self.start, self.slots, self.learned = time.monotonic(), 0, 0

    def add(self, slots: int, learned: int) -> None:
        self.slots += slots
        self.learned += learned

    def rates(self) -> dict[str, float]:
        seconds = max(time.monotonic() - self.start, 1e-9)
        return {"tokens_per_s": round(self.slots / seconds), "learned_per_s": round(self.learned / seconds)}


def lm_loss(model: Transformer, batch: Batch, replay_start: int = 0) -> Tensor:
    """Mean next-token cross-entropy over the learned tokens of a batch."""
    total, count = learned_token_loss(model, batch, replay_start)
    return total / max(count, 1)


class RoutingBalance:
    """Aux-loss-free balancing: after each step, nudge every gate's bias toward its under-used experts."""

    def __init__(self, model: nn.Module) -> None:
        self.counts: dict[Gate, Tensor] = {}
        self.handles = [g.register_forward_hook(self._count) for g in model.modules() if isinstance(g, Gate)]

    def _count(self, gate: Gate, _inputs: Any, output: tuple[Tensor, Tensor]) -> None:
        if gate.weight.requires_grad:  # frozen gates (DSpark phase backbone) keep their biases
            counts = torch.bincount(output[1].flatten(), minlength=gate.bias.shape[0]).float()
            self.counts[gate] = self.counts.get(gate, 0) + counts

    @torch.no_grad()
    def update(self) -> None:
        for gate, counts in self.counts.items():
            gate.bias += BIAS_SPEED * torch.sign(counts.mean() - counts)
        self.counts.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Schedule:
    """Linear warm-up, cosine decay to 10 %; progress = max(step / steps, elapsed / seconds)."""

    def __init__(self, peak: float, warmup: int, steps: int, seconds: float) -> None:
        self.peak, self.warmup, self.steps, self.seconds = peak, warmup, steps, seconds

    def progress(self, step: int, elapsed: float) -> float:
        if self.steps:
            return step / self.steps
        return elapsed / self.seconds if self.seconds > 0 else 1.0  # no steps and no time: nothing to do

    def lr(self, step: int, elapsed: float) -> float:
        p = min(1.0, self.progress(step, elapsed))
        return self.peak * min(1.0, (step + 1) / self.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))


class Trainer:
    def __init__(self, cfg: TrainConfig, log: Any) -> None:
        self.cfg, self.log = cfg, log
        self.device = torch.device(
            cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.args: ModelArgs = ModelArgs.from_json(Path(cfg.init) / "config.json") if cfg.init else preset(cfg.preset)
        self.work = cfg.work
        self.work.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = self._load_report()
        self.fitted: dict[tuple[str, int], int] = {}  # (footprint, requested) → tokens per batch (fit_budget)
        self.heldout = {
            kind: held_out_batches(cfg.seed, kind, 2, cfg.heldout_tokens, cfg.max_len) for kind in ("text", "tool")
        }

    # ------------------------------------------------------------------------------------------ bookkeeping
    def _load_report(self) -> dict[str, Any]:
        path = self.work / "report.json"
        return json.loads(path.read_text()) if path.exists() else {"phases": {}}

    def _save_report(self) -> None:
        tmp = self.work / "report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2))
        os.replace(tmp, self.work / "report.json")

    def _save(self, name: str, payload: dict[str, Any]) -> None:
        tmp = self.work / f"{name}.pt.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, self.work / f"{name}.pt")  # never a half-written state under the real name

    def _state(self, name: str) -> dict[str, Any] | None:
        path = self.work / f"{name}.pt"
        return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def new_model(self, state: dict[str, Tensor] | None = None) -> Transformer:
        seed = self.cfg.seed if state is None else None
        model = build_model(self.args, seed=seed, device=self.device, packed=False)  # float master weights
        if state is not None:
            model.load_state_dict(state)
        return model

    def batches(self, start: int, mix: tuple[float, ...], tokens: int) -> Iterator[tuple[Batch, int]]:
        """Batches from step `start` on, on the device, each with its number of learned tokens (counted on the host);
        `mix`: the share of each of data.KINDS (0: none)."""
        dataset = StepBatches(self.cfg.seed, tokens, self.cfg.max_len, mix)
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=range(start, len(dataset)),
            num_workers=self.cfg.workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=4 if self.cfg.workers else None,
        )
        for batch in loader:
            yield batch.to(self.device), batch.n_targets

    # -------------------------------------------------------------------------------------------- the loop
    def fit_budget(
        self, name: str, model: Transformer, requested: int, trial: Callable[[Batch], Tensor], footprint: str
    ) -> int:
        """The largest of `requested`, ¾ of it, ¾ of that, … tokens per batch whose worst case (rows of max_len
        tokens, every one learned) trains within MEMORY_SHARE of the GPU's memory; `requested` on a CPU.

        `trial(batch)` is the phase's loss of a batch; its gradients are dropped. Phases of the same `footprint`
        asking for the same budget share the first one's answer (QAT's stored-format weights add little to the
        backbone's memory).
        """
        if self.device.type != "cuda":
            return requested
        if (footprint, requested) in self.fitted:
            return self.fitted[footprint, requested]
        cfg = self.cfg
        budget = min(requested, MAX_BATCH_TOKENS // cfg.max_len * cfg.max_len)
        total = torch.cuda.get_device_properties(self.device).total_memory
        generator = torch.Generator().manual_seed(cfg.seed)
        while True:
            rows = max(1, budget // cfg.max_len)
            tokens = torch.randint(3, self.args.vocab_size, (rows, cfg.max_len), generator=generator)
            worst = Batch("probe", tokens, torch.ones_like(tokens, dtype=torch.bool)).to(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            try:
                self._trial_step(trial, worst)
                peak = torch.cuda.max_memory_allocated(self.device)
            except torch.cuda.OutOfMemoryError:
                peak = math.inf
            model.zero_grad(set_to_none=True)
            fits = peak <= MEMORY_SHARE * total
            self.log.info("batch fit", phase=name, tokens=budget, peak_gib=round(peak / 2**30, 1), fits=fits)
            if fits or rows == 1:
                torch.cuda.empty_cache()
                self.fitted[footprint, requested] = budget
                return budget
            budget = (rows * 3 // 4) * cfg.max_len

    def _trial_step(self, trial: Callable[[Batch], Tensor], batch: Batch) -> None:
        with self.autocast():
            loss = trial(batch)
        loss.backward()

    def run_phase(
        self,
        name: str,
        model: Transformer,
        params: list[nn.Parameter],
        step_loss: Callable[[Batch, int], tuple[Tensor, dict[str, float]]],
        schedule: Schedule,
        mix: tuple[float, ...],
        tokens: int,
        footprint: str,
        evaluate: Callable[[], dict[str, float]] | None = None,
    ) -> PhaseResult:
        """Optimise `params` on `step_loss` until the schedule ends; resumable from `<name>.partial.pt`.

        Batches of data.KINDS in the shares `mix`, `tokens` per batch, or fewer where the worst case would not fit in
        GPU memory (`fit_budget`). Every `eval_every` steps the step is logged with the throughput, and with
        `evaluate()`'s held-out figures when given.
        """
        cfg = self.cfg
        optimizer = torch.optim.AdamW(
            params, lr=schedule.peak, betas=(0.9, 0.95), weight_decay=0.0, fused=self.device.type == "cuda"
        )
        step, elapsed, last_loss = 0, 0.0, torch.tensor(math.nan)
        partial = self._state(f"{name}.partial")
        if partial is not None:
            model.load_state_dict(partial["model"])
            optimizer.load_state_dict(partial["optimizer"])
            step, elapsed, tokens = partial["step"], partial["elapsed"], partial["tokens"]
            self.log.info("resume", phase=name, step=step, elapsed=round(elapsed, 1), tokens=tokens)
        else:
            tokens = self.fit_budget(name, model, tokens, lambda batch: step_loss(batch, 0)[0], footprint)
        balance = RoutingBalance(model)
        start = time.monotonic() - elapsed
        seen = Throughput()
        bar = tqdm(desc=name, total=schedule.steps or None, initial=step, unit="step", dynamic_ncols=True)
        for batch, learned in self.batches(step, mix, tokens):
            elapsed = time.monotonic() - start
            if schedule.progress(step, elapsed) >= 1.0:
                break
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step, elapsed)
            with self.autocast():
                loss, info = step_loss(batch, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            balance.update()
            last_loss, step = loss.detach(), step + 1
            seen.add(batch.tokens.numel(), learned)
            bar.update(1)
            if step % cfg.eval_every == 0 or step == 1:  # the only host syncs of a step, besides the model's own
                heldout = evaluate() if evaluate is not None and step % cfg.eval_every == 0 else {}
                bar.set_postfix(loss=f"{float(last_loss):.3f}", kind=batch.kind)
                self.log.info("step", phase=name, step=step, loss=round(float(last_loss), 4), kind=batch.kind,
                              grad_norm=round(float(grad_norm), 3), lr=f"{optimizer.param_groups[0]['lr']:.2e}",
                              elapsed=round(elapsed, 1), **seen.rates(), **{k: round(v, 4) for k, v in info.items()},
                              **{f"heldout_{k}": round(v, 4) for k, v in heldout.items()})  # fmt: skip
            if step % cfg.save_every == 0:
                self._save(f"{name}.partial", {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                               "step": step, "elapsed": elapsed, "tokens": tokens})  # fmt: skip
        bar.close()
        balance.close()
        return PhaseResult(step, time.monotonic() - start, float(last_loss), {}, tokens, seen.rates())

    def lm_phase(self, name: str, model: Transformer, peak: float, steps: int, seconds: float) -> PhaseResult:
        cfg = self.cfg

        def step_loss(batch: Batch, step: int) -> tuple[Tensor, dict[str, float]]:
            rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            T, W = batch.tokens.shape[1], self.args.sliding_window
            replay = (
                batch.kind in CONVERSATION_KINDS and T > W and float(torch.rand(1, generator=rng)) < cfg.replay_share
            )
            start = int(torch.randint(0, T - W, (1,), generator=rng)) if replay else 0
            return lm_loss(model, batch, start), {"replay_start": float(start)}

        def evaluate() -> dict[str, float]:
            with torch.no_grad(), self.autocast():
                return heldout_losses(model, self.heldout)

        params = [p for p in model.parameters() if p.requires_grad]
        schedule = Schedule(peak, cfg.warmup, steps, seconds)
        result = self.run_phase(
            name, model, params, step_loss, schedule, cfg.mix, cfg.batch_budget, "backbone", evaluate
        )
        result.heldout = evaluate()
        return result

    def finish_phase(self, name: str, model: Transformer, result: PhaseResult, **extra: Any) -> None:
        self._save(name, {"model": model.state_dict()})
        self.report["phases"][name] = {**asdict(result), **extra}
        self._save_report()
        (self.work / f"{name}.partial.pt").unlink(missing_ok=True)
        self.log.info("phase done", phase=name, **{k: v for k, v in asdict(result).items() if k != "heldout"},
                      heldout={k: round(v, 4) for k, v in result.heldout.items()})  # fmt: skip

    # ------------------------------------------------------------------------------------------- phases
    def budget(self, share: float) -> float:
        return self.cfg.minutes * 60 * share

    def base(self) -> dict[str, Tensor]:
        """Seeded weights, or a trained checkpoint (`init`) to continue, trained with bf16 main KV."""
        done = self._state("base")
        if done is not None:
            return done["model"]
        if self.cfg.init:
            model = load_checkpoint(self.cfg.init, device=self.device, packed=False)
            self.report["init"] = {"checkpoint": self.cfg.init, **self._init_report()}
        else:
            model = self.new_model()
        with qat.main_kv("bf16"):
            result = self.lm_phase("base", model, self.cfg.lr, self.cfg.base_steps, self.budget(self.cfg.base_share))
        self.finish_phase("base", model, result)
        return model.state_dict()

    def _init_report(self) -> dict[str, Any]:
        path = Path(self.cfg.init) / "training.json"
        return {"training": json.loads(path.read_text())} if path.exists() else {}

    def quantised(self, name: str, base: dict[str, Tensor], kv: qat.KVFormat, steps: int) -> tuple[Transformer, int]:
        """`qat` (FP4 main KV) or `twin` (bf16 main KV) from the base weights, stored-format weights on."""
        done = self._state(name)
        if done is not None:
            model = self.new_model(done["model"])
            return model, self.report["phases"][name]["steps"]
        model = qat.stored_weights(self.new_model(base))
        with qat.main_kv(kv):
            result = self.lm_phase(name, model, self.cfg.qat_lr, steps, self.budget(self.cfg.qat_share))
        qat.bake(model)
        self.finish_phase(name, model, result, main_kv=kv)
        return model, result.steps

    def qat_claim(self, qat_model: Transformer, twin: Transformer) -> dict[str, Any]:
        """Held-out loss with FP4 vs bf16 main KV, for the QAT model and its no-QAT twin."""
        claim: dict[str, Any] = {}
        for label, model in (("qat", qat_model), ("no_qat", twin)):
            losses = {}
            for kv in ("fp4", "bf16"):
                with torch.no_grad(), self.autocast(), qat.main_kv(kv):
                    losses[kv] = heldout_losses(model, self.heldout)
            claim[label] = {kv: {kind: round(v, 5) for kind, v in per_kind.items()} for kv, per_kind in losses.items()}
            claim[label]["fp4_vs_bf16_percent"] = {
                kind: round(100 * (losses["fp4"][kind] / losses["bf16"][kind] - 1), 3) for kind in losses["fp4"]
            }
        self.report["qat_claim"] = claim
        self._save_report()
        self.log.info("qat claim", **claim)
        return claim

    def anchors(self, batch: Batch, generator: torch.Generator) -> Tensor:
        """Per-row DSpark anchors: `anchors` per row, fewer where rows × anchors × γ would pass `draft_rows`."""
        g = self.args.dspark_block_size
        n = max(1, min(self.cfg.anchors, self.cfg.draft_rows // (batch.tokens.shape[0] * g)))
        return dspark.pick_anchors(batch.targets.cpu(), n, g, generator).to(self.device)

    def dspark(self, model: Transformer) -> Transformer:
        done = self._state("dspark")
        if done is not None:
            model.load_state_dict(done["model"])
            return model
        cfg = self.cfg
        model.requires_grad_(False)
        for name, p in model.mtp.named_parameters():
            p.requires_grad_(not name.endswith(("gate.bias", "gate.bias_vl")))  # routing biases: RoutingBalance
        generator = torch.Generator().manual_seed(cfg.seed)

        def step_loss(batch: Batch, step: int) -> tuple[Tensor, dict[str, float]]:
            out = dspark.draft_forward(model, batch.tokens, batch.targets, self.anchors(batch, generator))
            loss, parts = dspark.dspark_loss(out)
            return loss, {**parts, "accepted_length": dspark.expected_accepted_length(out)}

        params = [p for p in model.mtp.parameters() if p.requires_grad]
        schedule = Schedule(cfg.dspark_lr, cfg.warmup, cfg.dspark_steps, self.budget(cfg.dspark_share))
        mix = (*cfg.dspark_mix, 0.0)  # no text
        result = self.run_phase("dspark", model, params, step_loss, schedule, mix, cfg.dspark_batch_budget, "dspark")
        self.finish_phase("dspark", model, result)
        return model

    def calibrate(self, model: Transformer) -> calibrate.Calibration:
        cfg = self.cfg
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        logits, accepted, valid = [], [], []
        lengths: dict[str, list[float]] = {kind: [] for kind in CONVERSATION_KINDS}  # per held-out batch, per anchor
        with torch.no_grad(), self.autocast():
            for kind in CONVERSATION_KINDS:
                for batch in held_out_batches(cfg.seed, kind, 2, cfg.dspark_batch_budget, cfg.max_len):
                    batch = batch.to(self.device)
                    out = dspark.draft_forward(model, batch.tokens, batch.targets, self.anchors(batch, generator))
                    rows = out.valid[..., 0]
                    logits.append(out.confidence[rows])
                    accepted.append(dspark.greedy_acceptance(out)[rows])
                    valid.append(out.valid[rows])
                    lengths[kind].append(dspark.expected_accepted_length(out))
        result = calibrate.sequential_temperature_scaling(torch.cat(logits), torch.cat(accepted), torch.cat(valid))
        self.report["calibration"] = {**asdict(result), "teacher_forced_accepted_length": lengths}
        self._save_report()
        self.log.info("calibration", **asdict(result))
        return result

    # ---------------------------------------------------------------------------------------------- all
    def run(self) -> Path:
        cfg = self.cfg
        self.log.info("device", device=str(self.device), model=cfg.init or cfg.preset, work=str(self.work))
        base = self.base()
        model, steps = self.quantised("qat", base, "fp4", cfg.qat_steps)
        if cfg.twin:
            twin, _ = self.quantised("twin", base, "bf16", steps)
            self.qat_claim(model, twin)
            del twin
        model = self.dspark(model)
        calibration = self.calibrate(model)
        out = export_checkpoint(model, Path(cfg.out), calibration.temperatures, self.report)
        self.log.info("checkpoint written", out=str(out))
        return out
