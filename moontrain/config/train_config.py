"""The train: section (TrainConfig): steps, batch geometry, logging, run directory, compile, recompute, kernel warm-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int  # optimizer steps of the run
    global_batch_size: int  # sequences per optimizer step over all ranks
    seq_len: int  # tokens per sequence
    # sequences per rank per forward/backward; None: global_batch_size / world size (one pass per step).
    # Smaller values accumulate gradients over global / (world * micro) passes per optimizer step
    micro_batch_size: int | None = None
    seed: int = 0  # the model's initial weights (data.seed seeds the data)
    log_every: int = 1  # a metrics line (console, metrics.jsonl, wandb) every this many steps
    run_dir: str = "runs/default"  # config.yaml, console.log, metrics, heatmaps and (by default) checkpoints
    # recompute blocks in backward instead of keeping their activations: true every layer, false none, an integer
    # n the n layers that free the most memory, "auto" the fewest of those whose estimate fits the GPU (none on
    # a GPU where everything fits, and on CPU), chosen at launch (moontrain.planning.activations)
    activation_checkpointing: bool | int | Literal["auto"] = False
    # torch.compile the dense parts of every block (norms, attention, dense FFN / shared experts) and the
    # loss: fuses their elementwise work and casts; routed experts and their communication stay eager.
    # The first step of each shape compiles (tens of seconds on a GPU; inductor caches on disk)
    compile: bool = False
    # divergence policy: a step with a non-finite grad norm skips its optimizer update; this many in a
    # row stop the run with an error (moontrain.trainer.guard)
    max_skipped_steps: int = 5
    # Triton kernels compiled before the first step in parallel processes, from a manifest of their
    # specialisations (moontrain.trainer.kernel_warmup, warmup_pool): "auto" the shipped recipes/data/triton_kernels_sm90.json
    # on a CUDA job whose cache lacks them, a manifest's path, or "none"
    kernel_warmup: str = "auto"
    kernel_warmup_workers: int = 8  # processes compiling them (each holds a CUDA context while it runs)
    # bitwise-reproducible runs on the GPU (deterministic kernels only; moontrain.trainer.determinism);
    # costs step time, so off by default
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "seq_len", "log_every", "max_skipped_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.kernel_warmup_workers < 0:
            raise ValueError(f"train.kernel_warmup_workers must be >= 0 (0: no warm-up), got {self.kernel_warmup_workers}")
        ac = self.activation_checkpointing
        if not isinstance(ac, bool) and ac != "auto" and (not isinstance(ac, int) or ac < 0):
            raise ValueError(f"train.activation_checkpointing must be true, false, auto or a number of layers >= 0, "
                             f"got {ac!r}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"train.micro_batch_size must be >= 1 or null (no accumulation), got {self.micro_batch_size}")

    def micro_batch(self, world_size: int) -> int:
        """Sequences per rank per forward/backward pass."""
        return self.micro_batch_size or self.global_batch_size // world_size

    def accumulation_steps(self, world_size: int) -> int:
        """Forward/backward passes per optimizer step."""
        return self.global_batch_size // world_size // self.micro_batch(world_size)
