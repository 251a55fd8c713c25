"""The --dry-run's step-time prediction for a GPU layout: compute at a measured MFU, expert tokens over the
network at an assumed bandwidth (docs/scale.md has the model and where it could be wrong).

Compute per rank per step: flops_per_token (6 x active matmul parameters + attention mixing) x tokens per
rank, plus one more forward (a third of that) under activation checkpointing, at `mfu` of the bf16 peak.
Network, when the EP group spans hosts (the all-to-all backend over ep / GPUs-per-host hosts; moonep over
parallel.ep_hosts hosts, hierarchical EP, moonep.hierarchical): every MoE layer
sends each token once to every remote host holding one of its experts and receives the partial sums back,
at the expert width in bf16, in each pass (forward, backward, and the recomputed forward). Remote hosts per
token: with K distinct experts drawn uniformly over G hosts, (G - 1)(1 - C(E - E/G, K) / C(E, K)); group-limited routing with
one expert group per host caps it at topk_expert_groups.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from moontrain.config.run_config import RunConfig
from moontrain.metrics.flops import flops_per_token
from moontrain.parallel.hosts import H200_HOST_GPUS
from moontrain.planning.activations import configured_recompute


@dataclass(kw_only=True, slots=True)
class StepTimeAssumptions:
    peak_flops: float = 989e12  # H200 dense bf16
    mfu: float = 0.356  # moonep on k3_small_moe, 2 x H200 (docs/performance.md)
    network_bytes_per_s: float = 50e9  # per GPU and direction between hosts (a 400 Gb/s NIC per GPU): assumed
    gpus_per_host: int = H200_HOST_GPUS


@dataclass(kw_only=True, slots=True)
class StepTimePrediction:
    compute_s: float
    network_bytes: float  # per rank per step, each direction
    network_s: float
    remote_hosts_per_token: float

    @property
    def overlapped_s(self) -> float:  # network fully hidden under compute (or the reverse)
        return max(self.compute_s, self.network_s)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.network_s


def remote_hosts_per_token(hosts: int, experts: int, topk: int, groups: int, top_groups: int) -> float:
    """Expected number of other hosts holding one of a token's K distinct experts (experts spread evenly,
    drawn uniformly: a host is missed with probability C(E - E/G, K) / C(E, K))."""
    if hosts <= 1:
        return 0.0
    missed = math.comb(experts - experts // hosts, topk) / math.comb(experts, topk)
    expected = (hosts - 1) * (1 - missed)
    if groups == hosts and top_groups < hosts:  # one expert group per host: at most top_groups hosts
        expected = min(expected, float(top_groups))
    return expected


def predict_step_time(cfg: RunConfig, world_size: int, a: StepTimeAssumptions,
                      recomputed: Collection[int] | None = None) -> StepTimePrediction:
    """recomputed: the layers activation checkpointing recomputes (None: train.activation_checkpointing's, none
    for an unresolved "auto")."""
    m, tr = cfg.model, cfg.train
    tokens = tr.global_batch_size // world_size * tr.seq_len
    if recomputed is None:
        recomputed = configured_recompute(cfg, 2) or ()
    share = len(recomputed) / m.num_layers  # the recomputed layers' share of the forward
    passes = 2 + share
    recompute = 1 + share / 3  # one more forward of those layers: 2 of the 6 FLOPs per parameter
    compute_s = flops_per_token(m, tr.seq_len) * tokens * recompute / (a.peak_flops * a.mfu)
    hosts = max(1, cfg.parallel.ep // a.gpus_per_host) if cfg.experts.backend != "moonep" else cfg.parallel.ep_hosts
    remote = remote_hosts_per_token(hosts, m.num_experts, m.num_experts_per_tok, m.num_expert_groups,
                                    m.topk_expert_groups)
    per_layer_pass = tokens * remote * m.expert_width * 2 * 2  # rows out and partial sums back, bf16
    network = per_layer_pass * passes * m.num_moe_layers
    return StepTimePrediction(compute_s=compute_s, network_bytes=network, network_s=network / a.network_bytes_per_s,
                              remote_hosts_per_token=remote)


def step_time_lines(cfg: RunConfig, world_size: int, a: StepTimeAssumptions | None = None,
                    recomputed: Collection[int] | None = None) -> list[str]:
    a = a or StepTimeAssumptions()
    p = predict_step_time(cfg, world_size, a, recomputed)
    return [
        "== step time (prediction; docs/scale.md) ==",
        f"  assumptions: {a.peak_flops / 1e12:.0f} TFLOP/s peak at MFU {a.mfu:.1%} (measured: k3_small_moe, 2 x H200); "
        f"{a.network_bytes_per_s / 1e9:.0f} GB/s per GPU between hosts (assumed); {a.gpus_per_host} GPUs per host",
        f"  compute {p.compute_s:.2f} s; expert tokens over the network {p.network_bytes / 1e9:.1f} GB per rank "
        f"({p.remote_hosts_per_token:.1f} remote hosts per token) = {p.network_s:.2f} s",
        f"  step {p.overlapped_s:.2f} s if the network hides under compute, {p.serial_s:.2f} s if not",
    ]
