"""The --dry-run report: parallel layout, parameter counts, per-rank memory estimate, and on GPU a predicted
step time (moontrain.planning.step_time)."""

from __future__ import annotations

from moonep import remote_experts
from moontrain.config.run_config import RunConfig
from moontrain.model.params import count_params
from moontrain.planning.activations import describe_recompute
from moontrain.planning.memory import ROWS, MemoryEstimate, estimate_memory, planned_recompute
from moontrain.planning.preflight import smaller_settings, visible_gpu_memory
from moontrain.planning.step_time import step_time_lines


def dry_run_report(cfg: RunConfig, world_size: int, device: str,
                   gpu_memory: tuple[str, float] | None = None) -> str:
    """gpu_memory: (what, bytes) of the GPU the run will use (default: the visible one, else an H200's)."""
    m, R = cfg.model, cfg.parallel.ep
    epn = m.num_experts // R
    dtype = cfg.parallel.compute_dtype
    compute_bytes = 4 if dtype == "float32" or (dtype == "auto" and device == "cpu") else 2
    counts = count_params(m)
    if device == "cuda":
        what, have = gpu_memory if gpu_memory is not None else visible_gpu_memory()
    recomputed = planned_recompute(cfg, counts, world_size, compute_bytes, have if device == "cuda" else None)
    mem = estimate_memory(cfg, counts, world_size, compute_bytes, recomputed)
    tokens_per_rank = cfg.train.global_batch_size // world_size * cfg.train.seq_len
    lines = [
        "== layout ==",
        (f"world {world_size} = dp_replicate {world_size // R} x ep {R}; experts backend {cfg.experts.backend}; "
         f"compute {'bf16' if compute_bytes == 2 else 'fp32'} on {device}"),
        *([f"hierarchical EP: the EP group spans {cfg.parallel.ep_hosts} hosts of {R // cfg.parallel.ep_hosts} "
           f"ranks (moonep inside each host, all-to-alls between hosts; host stage sized for "
           f"{cfg.parallel.ep_hosts} x the tokens per rank)"] if cfg.parallel.ep_hosts > 1 else []),
        f"experts: E={m.num_experts}, epn={epn} per rank"
        + (f", B={_slots(cfg)} prefetch slots per projection (what the planner can fill: epn, none on one rank)"
           if cfg.experts.backend == "moonep" else "")
        + f", top-{m.num_experts_per_tok}, expert shape {m.expert_width}x{m.moe_intermediate_size}",
        ("dense params: " + {"fsdp": f"FSDP2 over {world_size} ranks", "plain": "plain (one rank, no FSDP)",
                             "allreduce": "fp32 on every rank, grads all-reduced (no FSDP)"}[cfg.parallel.dense_at(world_size)]
         + f"; expert grads: reduced over {world_size // R} replicas (local rows only)"),
        f"tokens per rank per step: {tokens_per_rank} ({cfg.train.global_batch_size // world_size} x {cfg.train.seq_len}"
        f"{_accumulation(cfg, world_size)})",
        "== parameters ==",
        f"total {_num(counts.total)}   active per token {_num(counts.active)}",
    ]
    for name in ("embedding", "attention", "dense_ffn", "routed_experts", "shared_experts", "router_and_latent",
                 "norms", "attn_res"):
        lines.append(f"  {name:<18} {_num(getattr(counts, name))}")
    lines.append("== memory per rank (estimate) ==")
    lines.append(f"  {'':<16} {'dense':>12} {'experts':>12} {'total':>12}")
    for name in ROWS:
        dense, experts = mem.dense.get(name, 0.0), mem.experts.get(name, 0.0)
        lines.append(f"  {name:<16} {_bytes(dense):>12} {_bytes(experts):>12} {_bytes(dense + experts):>12}")
    lines.append(f"  {'total':<16} {'':>12} {'':>12} {_bytes(mem.total):>12}")
    recompute = (f"train.activation_checkpointing={_setting(cfg.train.activation_checkpointing)}: "
                 f"{describe_recompute(cfg, recomputed)}")
    if device == "cuda":
        fits = mem.total <= have
        lines.append(f"  (activations: {recompute}; {what} has {_bytes(have)}: "
                     f"{'fits' if fits else 'does NOT fit'})")
        if not fits:
            lines += [f"  {line}" for line in smaller_settings(cfg, world_size, compute_bytes, have)]
    else:  # the host-memory check follows under == checks ==
        lines.append(f"  (activations: {recompute})")
    if mem.heap:
        lines += _heap_lines(cfg, mem)
    if device == "cuda":
        lines += step_time_lines(cfg, world_size, recomputed=recomputed)
    return "\n".join(lines)


def _setting(value: bool | int | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_HEAP_ROLES = {
    "comm": "receive rows [NvS+2, H] (+ combine rows with combine_reduce=source), landing rows [S*K+1, H], row metadata",
    "weights": "this rank's expert rows, every MoE layer (the weights row above)",
    "grads": "their fp32 grad mirror (the grads row above)",
    "slot_pool": "B copies of remote experts, one set for all layers",
    "reduce_pool": "the slot copies' fp32 grads",
}


def _slots(cfg: RunConfig) -> int:
    """B of the moonep Buffer the trainer builds (the host Buffer under hierarchical EP)."""
    N = cfg.parallel.ep_hosts
    return remote_experts(cfg.model.num_experts // N, cfg.parallel.ep // N)


def _heap_lines(cfg: RunConfig, mem: MemoryEstimate) -> list[str]:
    """The symmetric heap region by region (moonep.Layout.heap_bytes), and the allocator's share of the estimate:
    a GPU's peak is the allocator's peak plus the heap."""
    lines = [f"== symmetric heap per rank (moonep, outside the PyTorch allocator; B={_slots(cfg)}) =="]
    lines += [f"  {name:<16} {_bytes(n):>12}   {_HEAP_ROLES[name]}" for name, n in mem.heap.items()]
    lines.append(f"  {'heap total':<16} {_bytes(sum(mem.heap.values())):>12}")
    lines.append(f"  {'allocator':<16} {_bytes(mem.allocator):>12}   the estimate's total less the heap")
    return lines


def _num(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit} ({n:,})"
    return str(n)


def _bytes(n: float) -> str:
    if n == 0:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _accumulation(cfg: RunConfig, world_size: int) -> str:
    n = cfg.train.accumulation_steps(world_size)
    return f", {n} passes of {cfg.train.micro_batch(world_size)} sequences" if n > 1 else ""
