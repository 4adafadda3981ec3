"""`python -m train [--flags]`: train the demo checkpoint (see train/config.py for every flag, TRAIN_* env)."""

from __future__ import annotations

import os
import sys

from mesh.config import config_dict, load_config
from mesh.logging import configure_logging
from train.config import TrainConfig


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(TrainConfig, argv, env_prefix="TRAIN", prog="python -m train")
    log = configure_logging("train", level=cfg.log_level, json=not sys.stderr.isatty())
    log.info("config", **config_dict(cfg))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # data-loader workers fork after the parent tokenised
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # batches of many shapes
    from train.trainer import Trainer  # torch is imported only once the flags are valid

    try:
        trainer = Trainer(cfg, log)  # resolves the preset or the --init checkpoint
    except (ValueError, FileNotFoundError) as exc:
        log.error("cannot start training", error=str(exc))
        return 2
    trainer.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
