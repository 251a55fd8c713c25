"""The run config: composition of the component configs, plus cross-component checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from moontrain.checkpoint.config import CheckpointConfig
from moontrain.config.eval_config import EvalConfig
from moontrain.config.train_config import TrainConfig
from moontrain.data.config import DataConfig
from moontrain.metrics.config import MetricsConfig
from moontrain.model.config import SHORT_CONV_WALK_TAPS, ExpertsConfig, KernelsConfig, ModelConfig
from moontrain.optim.config import OptimConfig
from moontrain.parallel.config import ParallelConfig


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A run: one section per component, each handed to the component that owns it.

    model: the architecture and its training settings (ModelConfig)
    train: steps, batch geometry, the run directory (TrainConfig)
    kernels: which kernels run the model's layers (KernelsConfig)
    experts: the routed experts' backend (ExpertsConfig)
    parallel: the layout over the ranks (ParallelConfig)
    optim: the optimizer and the lr schedule (OptimConfig)
    data: the token source (DataConfig)
    checkpoint: saving and resuming (CheckpointConfig)
    metrics: wandb and the expert-load heatmaps (MetricsConfig)
    eval: the held-out loss (EvalConfig)
    """

    model: ModelConfig
    train: TrainConfig
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        ac, layers = self.train.activation_checkpointing, self.model.num_layers
        if not isinstance(ac, bool) and isinstance(ac, int) and ac > layers:
            raise ValueError(f"train.activation_checkpointing={ac} layers, the model has model.num_layers={layers}; "
                             f"use at most {layers} (true recomputes every layer)")
        if self.kernels.short_conv_backward == "walk" and self.model.kda_conv_size > SHORT_CONV_WALK_TAPS:
            raise ValueError(f"kernels.short_conv_backward=walk takes at most {SHORT_CONV_WALK_TAPS} taps, "
                             f"model.kda_conv_size={self.model.kda_conv_size}; set kernels.short_conv_backward=tiles "
                             f"(any number of taps) or a smaller kda_conv_size")
        if self.eval.every and self.eval.every % self.train.log_every:
            raise ValueError(f"eval.every={self.eval.every} is not a multiple of train.log_every={self.train.log_every}; "
                             "evaluation results are logged with a step's metrics")

    def check_world(self, world_size: int) -> None:
        """Checks that need the world size (known only at launch)."""
        ep = self.parallel.ep
        if world_size % ep:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.ep={ep}; use --nproc a multiple of {ep} "
                f"or set parallel.ep to a divisor of {world_size}"
            )
        if self.model.num_experts % ep:
            raise ValueError(
                f"model.num_experts={self.model.num_experts} is not divisible by parallel.ep={ep}; "
                f"choose ep among the divisors of {self.model.num_experts}"
            )
        if self.parallel.dense == "plain" and world_size > 1:
            raise ValueError(f"parallel.dense=plain holds every dense parameter unsharded on one rank and reduces no "
                             f"grads: it runs at world size 1 only, got {world_size} ranks; use parallel.dense=auto "
                             f"(the default: fsdp at more than one rank), fsdp or allreduce for {world_size} ranks, or one rank")
        if self.train.global_batch_size % world_size:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} is not divisible by the world size "
                f"{world_size}; use a multiple of {world_size}"
            )
        per_rank = self.train.global_batch_size // world_size
        micro = self.train.micro_batch_size
        if micro is not None and per_rank % micro:
            raise ValueError(
                f"train.micro_batch_size={micro} does not divide the {per_rank} sequences per rank "
                f"(global_batch_size={self.train.global_batch_size} over {world_size} ranks); use a divisor of "
                f"{per_rank}"
            )
        if self.parallel.ep_hosts > 1 and self.experts.backend != "moonep":
            raise ValueError(f"parallel.ep_hosts={self.parallel.ep_hosts} is hierarchical expert parallelism, built on "
                             f"the moonep backend; set experts.backend=moonep, or parallel.ep_hosts=1 for "
                             f"experts.backend={self.experts.backend}")
        if self.parallel.ep_hosts > 1 and self.experts.moonep.kernels == "triton":
            raise ValueError("parallel.ep_hosts > 1 runs moonep's host stage in entries mode, which has no Triton "
                             "kernels yet; set experts.moonep.kernels=auto (or torch)")
        if self.experts.backend == "local" and ep != 1:
            raise ValueError(f"experts.backend=local holds all experts on each rank and needs parallel.ep=1, got {ep}")
