"""The K3-like decoder: embedding, pre-norm blocks (KDA or MLA + dense FFN or MoE), final norm, LM head, CE loss.

Legend: B batch, T sequence, D hidden, V vocab.

Residuals: standard (x + sublayer(norm(x))), or Block Attention Residuals with model.attn_res_block_size
(moontrain/model/attn_res.py): blocks then pass (completed blocks, partial sum) along instead of x.

Activation checkpointing (optional) recomputes each block in backward (non-reentrant). The recompute
re-runs the expert backend's collectives; every rank recomputes the same blocks in the same order,
so they stay matched. early_stop is off so a recompute always runs the whole block (a partial one
could stop inside a collective call). The router does not count tokens again while recomputing.

Hybrid layout: model.kda_layers_per_mla picks, per block, Kimi Delta Attention or MLA (ModelConfig.
layer_is_kda). Documents: with document_eos_id (the trainer passes the token source's EOS when
model.document_mask is on), every forward derives the packed documents from the input ids once and
every attention layer stays inside them (moontrain.model.documents). With deterministic_attention (the
trainer passes train.deterministic) causal attention on CUDA goes through flex_attention, whose
backward is deterministic, also without documents.

Head and loss: the training forward never materialises the [B, T, V] logits: lm_head's weight and the final
norm's output go to moontrain.model.lm_loss.linear_cross_entropy (the head and the CE fused over chunks of
tokens); logits() (generation, export parity) runs lm_head as a module. Evaluation calls the training forward.

Layout: the model is built knowing only which expert rows it holds (ExpertPlacement); recompute, compile,
the dense parameters' wrapping and the experts' backends are applied afterwards, in one order, by
moontrain.parallel.parallelize, through enable_activation_checkpointing and attach_experts_backends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moontrain.model.attention import MLAttention
from moontrain.model.attn_res import (
    CompletedBlocks,
    DepthAttention,
    complete_block,
    residual_add,
    residual_grad,
    starts_block,
)
from moontrain.model.config import KernelsConfig, ModelConfig
from moontrain.model.documents import DocumentMask, causal_flex_mask, document_mask
from moontrain.model.experts import ExpertPlacement, ExpertsContext, ExpertsRuntime, build_experts_runtime
from moontrain.model.ffn import GatedFFN
from moontrain.model.init import expert_stds, init_dense
from moontrain.model.kda.layer import KimiDeltaAttention, uses_fla
from moontrain.model.lm_loss import chunk_math, linear_cross_entropy
from moontrain.model.moe import MoE
from moontrain.model.norm import RMSNorm
from moontrain.model.rope import rope_cos_sin


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, kernels: KernelsConfig, placement: ExpertPlacement,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device)
        self.is_kda = cfg.layer_is_kda(layer_idx)
        self.attn = (KimiDeltaAttention(cfg, kernel=kernels.kda, conv=kernels.short_conv,
                                        conv_backward=kernels.short_conv_backward, recompute=kernels.kda_recompute,
                                        dqkg=kernels.kda_dqkg, intra=kernels.kda_intra,
                                        gate_norm=kernels.kda_gate_norm, walk=kernels.kda_walk, device=device)
                     if self.is_kda
                     else MLAttention(cfg, pad_head_dims=kernels.attn_pad_head_dims, device=device))
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device)
        self.is_moe = layer_idx >= cfg.num_dense_layers
        self.ffn = (MoE(cfg, ep_rank=placement.ep_rank, ep=placement.ep, router_gemm=kernels.router_gemm,
                        router_kernel=kernels.router, device=device)
                    if self.is_moe
                    else GatedFFN(cfg.hidden_size, cfg.dense_intermediate_size, cfg.ffn_activation, device=device))
        self.attn_res = cfg.attn_res_block_size > 0
        if self.attn_res:  # AttnRes: the attention's and the FFN's inputs are depth aggregations
            self.res_attn = DepthAttention(cfg.hidden_size, cfg.norm_eps, device=device, kernel=kernels.attn_res)
            self.res_ffn = DepthAttention(cfg.hidden_size, cfg.norm_eps, device=device, kernel=kernels.attn_res)
            self.starts_block = starts_block(layer_idx, cfg.attn_res_block_size)
        self.activation_checkpointing = False

    def forward(self, blocks: CompletedBlocks, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentMask | None = None) -> tuple[CompletedBlocks, torch.Tensor, torch.Tensor | None]:
        """(completed AttnRes blocks, residual stream or AttnRes partial sum) -> the same after this
        layer, and the MoE aux loss. Without AttnRes `blocks` holds () and passes through. docs: the packed
        documents attention stays inside."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, blocks, x_BTD, cos, sin, docs, use_reentrant=False, early_stop=False,
                              context_fn=lambda: (nullcontext(), self._recomputing()))
        return self._forward(blocks, x_BTD, cos, sin, docs)

    def _recomputing(self) -> AbstractContextManager[None]:
        return self.ffn.router.not_counting() if self.is_moe else nullcontext()

    def _forward(self, blocks: CompletedBlocks, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 docs: DocumentMask | None) -> tuple[CompletedBlocks, torch.Tensor, torch.Tensor | None]:
        values, x_BTD, aux = self.residuals(blocks.values, x_BTD, lambda h_BTD: self._mix(h_BTD, cos, sin, docs))
        return CompletedBlocks(values), x_BTD, aux

    def _mix(self, h_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
        """The sequence mixing, under a profiler range naming its kind (a profile's KDA / MLA share)."""
        with torch.profiler.record_function("mixing.kda" if self.is_kda else "mixing.mla"):
            return self.attn(h_BTD, cos, sin, docs)

    def residuals(self, blocks: tuple[torch.Tensor, ...], x_BTD: torch.Tensor,
                  attend: Callable[[torch.Tensor], torch.Tensor]
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None]:
        """This layer's residual wiring (standard or AttnRes) around attend(normed input) -> attention
        output: the training forward passes its attention, decoding the cached form of it."""
        if not self.attn_res:
            x_BTD = x_BTD + attend(self.attn_norm(x_BTD))
            y, aux = self._ffn(self.ffn_norm(x_BTD))
            return blocks, x_BTD + y, aux
        if self.starts_block:  # the partial sum becomes a completed block (the aggregation's last value) and a
            blocks = (*blocks, complete_block(x_BTD))  # new partial sum starts here
            x_BTD = attend(self.attn_norm(self.res_attn(blocks)))
        else:  # the aggregation and the residual add both read the partial sum: they sum its gradient
            sink = residual_grad(x_BTD)
            x_BTD = residual_add(x_BTD, attend(self.attn_norm(self.res_attn(blocks, x_BTD, sink))), sink)
        sink = residual_grad(x_BTD)
        y, aux = self._ffn(self.ffn_norm(self.res_ffn(blocks, x_BTD, sink)))
        return blocks, residual_add(x_BTD, y, sink), aux

    def _ffn(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_moe:
            return self.ffn(x_BTD)
        return self.ffn(x_BTD), None


class K3Model(nn.Module):
    """kernels: how the layers run (default: KernelsConfig()). placement: the expert rows this model holds (default:
    all of them; ParallelLayout.expert_placement on a rank of an EP group): the only layout knowledge the
    model is built with; moontrain.parallel.parallelize does the rest. document_eos_id: packed documents end
    with this id (None: one sequence per row). deterministic_attention: on CUDA causal attention goes
    through flex_attention, documents or not (train.deterministic)."""

    def __init__(self, cfg: ModelConfig, *, kernels: KernelsConfig | None = None,
                 placement: ExpertPlacement | None = None, document_eos_id: int | None = None,
                 deterministic_attention: bool = False, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        kernels = kernels or KernelsConfig()
        placement = placement or ExpertPlacement()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        self.layers = nn.ModuleList(
            Block(cfg, i, kernels=kernels, placement=placement, device=device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        # AttnRes: the final norm's input is one more aggregation over the blocks and the last partial sum
        self.final_res = (DepthAttention(cfg.hidden_size, cfg.norm_eps, device=device, kernel=kernels.attn_res)
                          if cfg.attn_res_block_size else None)
        # linear_cross_entropy's chunk math (kernels.lm_loss); parallelize's compile step compiles EAGER
        self.loss_math = chunk_math(kernels.lm_loss, device)
        self.document_eos_id = document_eos_id
        self.fla_seq_bounds = uses_fla(cfg, kernels.kda, device)  # the documents carry fla's cu_seqlens
        self.deterministic_attention = deterministic_attention
        self._rope_tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # rope_table's

    def rope_table(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_cos_sin of positions 0 .. seq_len - 1, made once per (length, device): building it copies the
        inverse frequencies from the host, a host sync on CUDA that every forward would pay."""
        key = (seq_len, str(device))
        if key not in self._rope_tables:
            cfg = self.cfg
            self._rope_tables[key] = rope_cos_sin(seq_len, cfg.qk_rope_head_dim, cfg.rope_theta, device,
                                                  yarn=cfg.rope_yarn)
        return self._rope_tables[key]

    def moe_layers(self) -> list[MoE]:
        return [block.ffn for block in self.layers if block.is_moe]

    @contextmanager
    def not_counting(self) -> Iterator[None]:
        """Forwards inside leave every router's balancing statistics alone (evaluation, calibration)."""
        with ExitStack() as stack:
            for moe in self.moe_layers():
                stack.enter_context(moe.router.not_counting())
            yield

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init independent of the parallel layout (moontrain.model.init: dense params from
        one seeded stream, experts from per-expert generators)."""
        gen = torch.Generator(device=self.embed.weight.device)
        gen.manual_seed(seed)
        init_dense(self, self.cfg, gen)
        for block in self.layers:
            if block.is_kda:
                block.attn.init_parameters(gen)
        moe_idx = 0
        for layer_idx, block in enumerate(self.layers):
            if block.is_moe:
                block.ffn.experts.init_master(seed=seed, layer_idx=moe_idx, stds=expert_stds(self.cfg, layer_idx))
                block.ffn.router.score_bias_E.zero_()
                moe_idx += 1

    def enable_activation_checkpointing(self, layers: Iterable[int] | None = None) -> None:
        """Recompute these layers' forward in backward (None: every layer)."""
        chosen = range(len(self.layers)) if layers is None else layers
        for i in chosen:
            if not 0 <= i < len(self.layers):
                raise ValueError(f"layer {i} to recompute: the model has {len(self.layers)} layers (0-based)")
            self.layers[i].activation_checkpointing = True

    def attach_experts_backends(self, name: str, ctx: ExpertsContext) -> ExpertsRuntime:
        """Give every MoE layer its backend of `name`; returns the runtime that owns what they share."""
        if self.moe_layers() and ctx.activation != self.cfg.ffn_activation:
            raise ValueError(f"the experts context computes {ctx.activation!r} experts, the model has "
                             f"model.ffn_activation={self.cfg.ffn_activation!r}; build the ExpertsContext with "
                             "activation=cfg.ffn_activation")
        runtime = build_experts_runtime(name, ctx)
        for moe in self.moe_layers():
            moe.backend = runtime.layer(moe.experts)
        return runtime

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                host_tokens_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (loss to backpropagate = CE + aux, CE alone for logging). The CE is the fp32 mean over
        the B T tokens of the head's logits, fused with the head (module docstring). host_tokens_BT: the same
        ids on the host (the data loader's copy), from which the documents' sequence bounds for fla come
        without a host sync; optional."""
        h_BTD, aux_total = self._hidden_aux(tokens_BT, host_tokens_BT)
        ce = linear_cross_entropy(h_BTD.flatten(0, 1), self.lm_head.weight, targets_BT.reshape(-1),
                                  math=self.loss_math)
        return ce + aux_total, ce.detach()

    def logits(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """LM-head logits [B, T, V] of the training forward (evaluation, generation, export parity)."""
        return self.lm_head(self._hidden_aux(tokens_BT)[0])

    def _hidden_aux(self, tokens_BT: torch.Tensor,
                    host_tokens_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The final norm's output [B, T, D] (the head's input) and the summed MoE aux loss."""
        T = tokens_BT.shape[1]
        cos, sin = self.rope_table(T, tokens_BT.device)
        docs = (document_mask(tokens_BT, self.document_eos_id, seq_bounds=self.fla_seq_bounds,
                              host_tokens_BT=host_tokens_BT)
                if self.document_eos_id is not None else None)
        if docs is None and self.deterministic_attention and tokens_BT.is_cuda:
            docs = causal_flex_mask(T, tokens_BT.device)
        x_BTD = self.embed(tokens_BT)
        aux_total = x_BTD.new_zeros((), dtype=torch.float32)
        blocks = CompletedBlocks()
        for block in self.layers:
            blocks, x_BTD, aux = block(blocks, x_BTD, cos, sin, docs)
            if aux is not None:
                aux_total = aux_total + aux
        if self.final_res is not None:
            x_BTD = self.final_res(blocks.values, x_BTD)
        return self.norm(x_BTD), aux_total
