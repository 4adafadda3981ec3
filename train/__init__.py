"""Training and evaluation of the demo checkpoint (model/checkpoints/v41-demo), reusing `model` and `recipe`.

`python -m train` trains it (GPU, minutes), `python -m train.eval` measures it, `python -m train.data` writes the
synthetic data. See docs/training.md.
"""
