"""moontrain tests never touch the network: wandb runs offline and Hugging Face libraries stay offline.

Set at import, before any test imports datasets or wandb, and inherited by the ranks and launches the
tests start."""

import os

os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
