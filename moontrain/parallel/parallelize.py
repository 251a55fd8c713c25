"""parallelize: the one step between a model built for this rank (K3Model with its ExpertPlacement, weights
initialised) and the model a train step runs. It applies, in this order:

1. activation checkpointing (train.activation_checkpointing, the layers moontrain.trainer.recompute chose):
   those blocks recompute their forward in backward (K3Model.enable_activation_checkpointing); the experts'
   backends are told (step 4), since a recompute re-runs their collectives.
2. torch.compile (train.compile), in place, of what runs between the routed experts: per block the norms
   (the MoE's latent norm included), the attention and the dense FFN or the shared experts; the AttnRes
   aggregations' math; the final norm and the loss's per-chunk math (moontrain.model.lm_loss). The routed
   experts (custom autograd functions around communication) stay eager. Before step 3, so the compiled modules live inside FSDP's units.
3. the dense parameters (parallel.dense): fsdp with a process group: FSDP2 per block, then the root
   (moontrain.parallel.fsdp); plain: FSDP's world-1 mixed precision with foreach casts and its hooks on the
   same modules (moontrain.parallel.plain_dense); allreduce, or fsdp without a process group: as built
   (allreduce: the trainer all-reduces the grads after backward). Expert masters are left alone by all three.
4. the experts runtime (experts.backend): one backend per MoE layer over the EP group, sharing what the
   runtime owns (moonep's symmetric heap: collective), accumulating expert grads times 1 / world size (the
   loss-mean factor, set here only; moontrain.trainer.trainer says why); then, with
   parallel.shard_expert_state, each expert master keeps its replica's rows.

The model keeps the mechanisms (what a recompute must not count again, how a backend attaches); this module
decides whether and in which order they apply, so the trainer, a benchmark or a test that wants the training
model calls one function. Rejected: the model applying them itself from a layout it was given (the model
then knows the mesh), and the trainer applying them one by one (the order then hides among the rest it builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moontrain.model.attn_res import DepthAttention
from moontrain.model.config import ExpertsConfig
from moontrain.model.experts import ExpertsContext, ExpertsRuntime
from moontrain.model.lm_loss import EAGER, compiled_math
from moontrain.model.transformer import K3Model
from moontrain.parallel.config import ParallelConfig
from moontrain.parallel.fsdp import apply_fsdp
from moontrain.parallel.layout import ParallelLayout
from moontrain.parallel.plain_dense import PlainDense


@dataclass(kw_only=True, slots=True)
class Parallelized:
    """What the train step needs from parallelize besides the model it changed in place."""

    fsdp: bool  # the dense parameters are FSDP2 modules (parallel.dense=fsdp with a process group)
    plain_dense: PlainDense | None  # parallel.dense=plain
    experts_ctx: ExpertsContext
    experts_runtime: ExpertsRuntime


def parallelize(model: K3Model, layout: ParallelLayout, *, parallel: ParallelConfig, experts: ExpertsConfig,
                compute_dtype: torch.dtype, max_tokens: int, recomputed: Sequence[int] = (),
                compile_dense: bool = False) -> Parallelized:
    """Collective with a process group: steps 1-4 of the module docstring on `model`, in place. max_tokens:
    tokens per rank per forward (micro-batch * seq_len), the experts' buffer bound; recomputed: the layers
    activation checkpointing recomputes."""
    if recomputed:
        model.enable_activation_checkpointing(recomputed)
    if compile_dense:
        compile_dense_parts(model)
    dense = parallel.dense_at(layout.world_size, layout.distributed)
    fsdp = layout.distributed and dense == "fsdp"
    plain_dense = PlainDense(model, compute_dtype, parallel.plain_accumulate) if dense == "plain" else None
    if fsdp:
        apply_fsdp(model, layout, param_dtype=compute_dtype, reshard_after_forward=parallel.fsdp_reshard_after_forward)
    cfg = model.cfg
    ctx = ExpertsContext(
        num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=layout.ep_group, ep=layout.ep,
        compute_dtype=compute_dtype, token_padding=experts.token_padding, max_tokens=max_tokens,
        device=layout.device, activation=cfg.ffn_activation, loss_scale=1.0 / layout.world_size,
        recomputed_in_backward=bool(recomputed), moonep=experts.moonep,
        ep_host_group=layout.ep_host_group, ep_rail_group=layout.ep_rail_group,
    )
    runtime = model.attach_experts_backends(experts.backend, ctx)
    if parallel.shard_expert_state:
        for moe in model.moe_layers():
            moe.experts.shard_state(layout.dp_replicate_rank, layout.dp_replicate, layout.edp_group)
    return Parallelized(fsdp=fsdp, plain_dense=plain_dense, experts_ctx=ctx, experts_runtime=runtime)


def compile_dense_parts(model: K3Model) -> None:
    """Step 2: torch.compile, in place, the dense parts the module docstring lists."""
    for module in model.modules():
        if isinstance(module, DepthAttention):
            module.compile_math()
    for block in model.layers:
        block.attn_norm.compile()
        block.attn.compile()
        block.ffn_norm.compile()
        if not block.is_moe:
            block.ffn.compile()
            continue
        if block.ffn.shared is not None:
            block.ffn.shared.compile()
        if block.ffn.latent:
            block.ffn.latent_norm.compile()
    model.norm.compile()
    if model.loss_math is EAGER:  # the Triton chunk math (kernels.lm_loss) stays
        model.loss_math = compiled_math()

