"""Shared helpers of the checkpoint tests: a small run config (the hybrid KDA/MLA layout) and full (canonical)
views of a trainer's state."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moontrain.checkpoint.manifest import DIGEST_KEY, MANIFEST, TRAIN_STATE, manifest_bytes
from moontrain.config import RunConfig, from_dict
from moontrain.trainer.trainer import Trainer

K3_BLOCK = {"ffn_activation": "situ_glu", "attn_res_block_size": 2}  # SiTU-GLU, AttnRes with a block per layer


def small_config(backend: str, ep: int, *, steps: int = 6, run_dir: str = "runs/test", data: dict | None = None,
                 checkpoint: dict | None = None, k3_block: bool = False) -> RunConfig:
    return from_dict(RunConfig, {
        "model": dict(vocab_size=260, hidden_size=64, num_layers=3, num_dense_layers=1, dense_intermediate_size=96,
                      num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                      moe_intermediate_size=64, moe_latent_size=32, routed_scaling_factor=2.0,
                      router_bias_update_rate=0.01, kda_layers_per_mla=2, kda_num_heads=2, kda_head_dim=16,
                      **(K3_BLOCK if k3_block else {})),  # KDA, KDA, MLA
        "kernels": {"kda": "torch"},
        "experts": {"backend": backend},
        "parallel": {"ep": ep},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
        "train": {"steps": steps, "global_batch_size": 4, "seq_len": 16, "seed": 5, "run_dir": run_dir},
        "data": data or {},
        "checkpoint": checkpoint or {},
        "metrics": {"wandb": False},
    })


def _full(trainer: Trainer, name: str, t: torch.Tensor) -> torch.Tensor:
    layout = trainer.layout
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    if ".experts.master." in name and layout.ep > 1:
        parts = [torch.empty_like(t) for _ in range(layout.ep)]
        dist.all_gather(parts, t.detach().contiguous(), group=layout.ep_group)
        return torch.cat(parts)
    return t.detach().clone()


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, router bias and optimizer state tensor at canonical shape (collective when distributed)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        out[name] = _full(trainer, name, p)
        st = trainer.optimizer.state.get(p)
        for key, value in (st or {}).items():  # Adam's exp_avg / exp_avg_sq / step, Muon's momentum_buffer
            out[f"{name}.{key}"] = _full(trainer, name, value) if value.ndim else value.clone()
    for i, moe in enumerate(trainer.model.moe_layers()):
        out[f"router_bias.{i}"] = moe.router.score_bias_E.clone()
    return out


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(got.keys() ^ want.keys())}"
    for name, ref in want.items():
        value = got[name]
        assert value.shape == ref.shape and value.dtype == ref.dtype, (what, name, value.shape, ref.shape)
        if not torch.equal(value, ref):
            idx = (value != ref).nonzero()[0].tolist()
            raise AssertionError(f"{what}: {name} differs first at {idx}: {value[tuple(idx)].item()!r} vs "
                                 f"{ref[tuple(idx)].item()!r}")


def train(trainer: Trainer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        stats = trainer.train_step()
        assert stats is not None  # log_every=1
        losses.append(stats.loss)
    return losses


def rewrite_saved_model(ckpt: Path, edit: Callable[[dict], dict]) -> None:
    """Replace the checkpoint's saved model config by edit(it), as another moontrain version would have
    written it, with the manifest's digests made to match."""
    state_path = ckpt / TRAIN_STATE
    state = json.loads(state_path.read_text())
    state["model"] = edit(state["model"])
    raw = json.dumps(state).encode()
    state_path.write_bytes(raw)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    del manifest[DIGEST_KEY]
    manifest["files"][TRAIN_STATE] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (ckpt / MANIFEST).write_bytes(manifest_bytes(manifest))
