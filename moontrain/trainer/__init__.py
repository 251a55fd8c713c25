"""The training loop (trainer.py) and the per-rank entry point torchrun starts (worker.py)."""
