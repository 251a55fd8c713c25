"""Saving and loading the whole train state; atomic directories; keep_last; `resume: auto`.

A checkpoint is a directory `<dir>/step_<step:08d>/`:

    rank_<r:05d>.safetensors   what rank r owns (see tensors.py): model.<name>, optim.<name>.<state name>
                               (AdamW's exp_avg / exp_avg_sq / step, Muon's momentum_buffer),
                               rng.rank<r>.cpu / .cuda
    train_state.json           step, tokens seen, LR schedule (and the steps it spans), optimizer
                               hyperparameters, the layout it was saved at, the model config, the
                               tokenizer (run_tokenizer.py), the wandb run id, per-rank data position
    manifest.json              written last: every file with its size and digest (a rank file: the sha256
                               of each of its blocks, see digest.py; train_state.json: one sha256), every
                               tensor's canonical shape and the (file, offset, rows) pieces that hold it,
                               whether every value is finite, the largest |weight|, and its own sha256
                               (manifest.py: the schema and the checks made before it is used)

Saving streams: each rank writes its tensors straight from the model and optimizer into its file, chunk by
chunk through reused staging buffers (safetensors_io.write_safetensors), hashing the bytes (the sha256 of
each 16 MiB block, on up to digest.THREADS threads) while they are written; its extra host memory is the
staging buffers, not the state. Ranks save in parallel. A save longer than REPORT_AFTER_S prints its size,
time and GB/s on rank 0.

Atomicity: every rank writes into `step_<step>.tmp/` and fsyncs its file; after a barrier rank 0 writes
train_state.json and manifest.json, fsyncs them and the directory, renames it to `step_<step>` and
fsyncs the parent. A directory is a checkpoint only when it has that name and its manifest: a save
killed at any point leaves at most a `.tmp` directory, which is ignored and removed by the next save.
All ranks must see one shared filesystem.

Loading checks the manifest (manifest.py), then verifies every file it reads against it (size, then its
block digests on several threads, or its one sha256 for a checkpoint of format v1; a resume verifies every
file once, spread over the ranks, before any rank loads: resume.py), so a missing or damaged file is
reported by name before any of its values is read, then reads each tensor's rows straight into the model /
optimizer tensor, each piece only after the file's own header agrees with the manifest about it.
Parameters and optimizer moments are read as canonical rows, so the EP and DP degree may differ from the
save. RNG states are restored when the world size is unchanged (rank r gets rank r's); the data position
is restored by the data source (exactly at the same world size).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moontrain.checkpoint.digest import BlockSha256
from moontrain.checkpoint.manifest import FORMAT, MANIFEST, TRAIN_STATE, manifest_bytes, read_manifest
from moontrain.checkpoint.safetensors_io import CHUNK_BYTES, write_safetensors
from moontrain.checkpoint.tensors import (
    RESTORE,
    CheckpointError,
    Ownership,
    Piece,
    TensorSource,
    expert_shard_ownership,
    local_tensor,
    ownership,
    separate_gate_up_names,
)
from moontrain.dataclass_dict import to_dict
from moontrain.model.config import saved_model_dict
from moontrain.optim.config import OptimConfig

if TYPE_CHECKING:
    from moontrain.checkpoint.state import TrainState

__all__ = ["FORMAT", "MANIFEST", "TRAIN_STATE"]  # manifest.py's names, as the checkpoint's files are named here too
_PREFIX = "step_"
_TMP = ".tmp"
REPORT_AFTER_S = 3.0  # a save that takes longer prints its size, time and throughput on rank 0
# a checkpoint whose largest |weight| exceeds the oldest kept checkpoint's this many times is not sound: finite
# values of a blown-up run (a huge learning rate) are no better to resume from than inf
MAX_GROWTH = 100.0


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(run: TrainState, root: str | Path, *, keep_last: int) -> Path:
    """Collective: write the train state of every rank as `<root>/step_<step>`; returns its path."""
    layout, root = run.layout, Path(root)
    final = root / checkpoint_name(run.step)
    tmp = root / (final.name + _TMP)
    if layout.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_PREFIX}*{_TMP}"):
            shutil.rmtree(stale)
        tmp.mkdir()
    _barrier(run)
    t0 = time.perf_counter()
    tensors, pieces = _collect_tensors(run)
    finite, max_abs = _health(tensors)
    file = f"rank_{layout.rank:05d}.safetensors"
    with BlockSha256() as digest:
        write_safetensors(tmp / file, [(name, tuple(t.shape), t.dtype, lambda t=t: t) for name, t in tensors.items()],
                          metadata={"format": "pt", "moontrain": FORMAT}, digest=digest)
    del tensors
    _fsync_file(tmp / file)
    entry = {"file": file, "digest": {"bytes": (tmp / file).stat().st_size, "block_bytes": digest.block_bytes,
                                      "block_sha256": digest.hexdigests()},
             "pieces": pieces, "rank_state": {"data": run.data.state_dict()}, "finite": finite, "max_abs": max_abs}
    entries = _gather(run, entry)
    if layout.rank == 0:
        state = _train_state(run, [e["rank_state"] for e in entries])
        state_bytes = json.dumps(state, indent=1).encode()
        _write_durable(tmp / TRAIN_STATE, state_bytes)
        files = {e["file"]: e["digest"] for e in entries}
        files[TRAIN_STATE] = {"bytes": len(state_bytes), "sha256": hashlib.sha256(state_bytes).hexdigest()}
        index: dict[str, dict[str, Any]] = {}
        for e in entries:
            for name, (offset, rows, shape) in e["pieces"].items():
                index.setdefault(name, {"shape": shape, "pieces": []})["pieces"].append([e["file"], offset, rows])
        finite = all(e["finite"] for e in entries)
        manifest = {"format": FORMAT, "step": run.step, "finite": finite,
                    "max_abs": max(e["max_abs"] for e in entries) if finite else None, "files": files,
                    "tensors": index}
        _write_durable(tmp / MANIFEST, manifest_bytes(manifest))
        _fsync_dir(tmp)
        if final.exists():  # the same step saved twice (checkpoint.every and the final save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        prune(root, keep_last)
        seconds, gb = time.perf_counter() - t0, sum(f["bytes"] for f in files.values()) / 1e9
        if seconds > REPORT_AFTER_S:
            print(f"moontrain: checkpoint {final.name} saved, {gb:.1f} GB in {seconds:.1f} s "
                  f"({gb / seconds:.2f} GB/s)", flush=True)
    _barrier(run)
    return final


def _health(tensors: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """Whether every floating-point tensor is finite, and the largest |value| of the model's (model.*): one
    max-abs reduction per CHUNK_BYTES of each tensor (it is nan or inf exactly when a value is), one host sync
    per device."""
    state: dict[torch.device, torch.Tensor] = {}  # the largest |value| of all tensors, of the model's
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            flat = t.reshape(-1)  # a copy only for a non-contiguous tensor
            step = max(1, CHUNK_BYTES // t.dtype.itemsize)
            for lo in range(0, flat.numel(), step):
                m = torch.linalg.vector_norm(flat[lo:lo + step], float("inf"), dtype=torch.float32)
                pair = torch.stack([m, m if name.startswith("model.") else torch.zeros_like(m)])
                state[t.device] = pair if t.device not in state else torch.maximum(state[t.device], pair)
    values = [v.tolist() for v in state.values()]
    finite = all(math.isfinite(everything) for everything, _ in values)
    return finite, max((model for _, model in values), default=0.0)


def _collect_tensors(run: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """This rank's share: name -> the tensor itself (local shard, not copied; the writer streams it to the file),
    and name -> [offset, rows, global shape]."""
    layout = run.layout
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list] = {}

    def whole(name: str, t: torch.Tensor) -> None:
        tensors[name] = t.detach()
        pieces[name] = [0, t.shape[0] if t.ndim else 0, list(t.shape)]

    def put(name: str, t: torch.Tensor, owner_of: torch.Tensor | None = None, own: Ownership | None = None) -> None:
        if own is None:
            own = ownership(name, owner_of if owner_of is not None else t, layout)
        if own.writes:
            tensors[name] = local_tensor(t).detach()
            pieces[name] = [own.offset, own.rows, list(own.global_shape)]

    names, shard_ids = _param_names(run)
    for name, t in _model_tensors(run.model).items():
        put(f"model.{name}", t, own=expert_shard_ownership(t, layout) if id(t) in shard_ids else None)
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            state = run.optimizer.state.get(p)
            if not state:
                continue
            name = names[id(p)]
            for key, value in state.items():
                if value.ndim == 0:  # Adam's step count: a scalar, the same on every rank
                    if layout.rank == 0:
                        whole(f"optim.{name}.{key}", value)
                else:  # moments (Adam's exp_avg / exp_avg_sq, Muon's momentum_buffer) follow the parameter
                    own = expert_shard_ownership(p, layout) if id(p) in shard_ids else None
                    put(f"optim.{name}.{key}", value, owner_of=p, own=own)
    whole(f"rng.rank{layout.rank}.cpu", torch.get_rng_state())
    if layout.device.type == "cuda":
        whole(f"rng.rank{layout.rank}.cuda", torch.cuda.get_rng_state(layout.device))
    return tensors, pieces


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (router biases) under their canonical (state-dict) names."""
    out = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf_name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{buf_name}" if module_name else buf_name] = buf
    return out


def _train_state(run: TrainState, rank_states: list[dict]) -> dict[str, Any]:
    layout = run.layout
    groups = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    return {
        "format": FORMAT,
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "world_size": layout.world_size,
        "ep": layout.ep,
        "dp_replicate": layout.dp_replicate,
        "experts_backend": run.experts_backend,
        "data_source": run.data_source,
        "wandb_run_id": run.wandb_run_id,
        "scheduler": run.scheduler.state_dict(),
        "schedule_steps": run.schedule_steps,
        "tokenizer": run.tokenizer,
        "param_groups": groups,
        "model": to_dict(run.model_config),
        "optim": to_dict(run.optim_config),
        "seeds": run.seeds,
        "ranks": rank_states,
    }


# ---------------------------------------------------------------------------------------------- load
def open_checkpoint(path: str | Path, *, verified: bool = False) -> tuple[dict[str, Any], TensorSource]:
    """Read and check the manifest and train state of one checkpoint; tensors are read on demand.
    verified: its files' digests were checked already (resume.resolve_resume), only their sizes are."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    manifest = read_manifest(path / MANIFEST)
    index = {name: (tuple(e["shape"]), [Piece(f, o, r) for f, o, r in e["pieces"]])
             for name, e in manifest["tensors"].items()}
    source = TensorSource(path, index, expected=manifest["files"], verified=verified)
    state_path = path / TRAIN_STATE
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint file {state_path} is missing")
    raw = state_path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != manifest["files"][TRAIN_STATE]["sha256"]:
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: its sha256 differs from the manifest; "
                              f"{RESTORE}")
    return json.loads(raw), source


def load_checkpoint(run: TrainState, path: str | Path, *, verified: bool = False) -> dict[str, Any]:
    """Restore the whole train state into `run` (any EP / DP layout); returns the train state.
    verified: see open_checkpoint."""
    state, source = open_checkpoint(path, verified=verified)
    saved_model, model = saved_model_dict(state["model"]), to_dict(run.model_config)
    if saved_model != model:
        diff = sorted(k for k in set(saved_model) | set(model) if saved_model.get(k) != model.get(k))
        raise CheckpointError(f"checkpoint {path} was saved with a different model config; differing keys: "
                              + ", ".join(f"model.{k} (saved {saved_model.get(k)!r}, now {model.get(k)!r})"
                                          for k in diff))
    if state["data_source"] != run.data_source:
        raise CheckpointError(f"checkpoint {path} was saved with data.source={state['data_source']}, the run has "
                              f"data.source={run.data_source}; its data position cannot be restored")
    load_model_tensors(run, source, prefix="model.")
    _load_optimizer(run, source, state)
    layout = run.layout
    if state["world_size"] == layout.world_size:
        torch.set_rng_state(source.full(f"rng.rank{layout.rank}.cpu"))
        if layout.device.type == "cuda" and f"rng.rank{layout.rank}.cuda" in source.index:
            torch.cuda.set_rng_state(source.full(f"rng.rank{layout.rank}.cuda"), layout.device)
    run.data.load_state_dict([r["data"] for r in state["ranks"]])
    run.step = state["step"]
    run.tokens_seen = state["tokens_seen"]
    run.wandb_run_id = state["wandb_run_id"]
    return state


@torch.no_grad()
def load_model_tensors(run: TrainState, source: TensorSource, *, prefix: str) -> None:
    """Copy the rows this rank owns of every parameter and persistent buffer from `source`. Sharded expert
    masters: the compute copies are read whole from `source` too (no collective)."""
    names, shard_ids = _param_names(run)
    for name, t in _model_tensors(run.model).items():
        own = expert_shard_ownership(t, run.layout) if id(t) in shard_ids else ownership(name, t, run.layout)
        key = prefix + name
        if tuple(source.shape(key)) != own.global_shape:
            raise CheckpointError(f"{source.root}: {key} has shape {list(source.shape(key))}, the model "
                                  f"has {list(own.global_shape)}")
        source.read_into(key, own.offset, own.rows, local_tensor(t))
    for w in run.experts:
        if w.sharded:
            offset = run.layout.ep_rank * w.num_local
            w.push_master({proj: source.rows(prefix + names[id(master)], offset, w.num_local)
                           for proj, master in w.master.items()})
        else:
            w.push_master()


@torch.no_grad()
def _param_names(run: TrainState) -> tuple[dict[int, str], set[int]]:
    """id(parameter) -> its canonical name, and the ids of the sharded expert masters (parallel.shard_expert_state:
    they and their moments hold their replica's canonical rows, expert_shard_ownership)."""
    names = {id(p): n for n, p in run.model.named_parameters()}
    shard_ids = {id(p) for w in run.experts if w.sharded for p in w.master.values()}
    return names, shard_ids


def _load_optimizer(run: TrainState, source: TensorSource, state: dict[str, Any]) -> None:
    opt = run.optimizer
    names, shard_ids = _param_names(run)
    saved_groups = {g["name"]: g for g in state["param_groups"]}
    missing = sorted(set(g["name"] for g in opt.param_groups) - set(saved_groups))
    if missing:
        raise CheckpointError(f"checkpoint has optimizer groups {sorted(saved_groups)}, the run's optimizer has "
                              f"{missing} too: it was saved with another optim.name; resume with that one")
    state_keys: dict[str, list[str]] = {}  # parameter name -> its saved optimizer state names
    for tensor_name in source.names():
        if tensor_name.startswith("optim."):
            param, _, key = tensor_name[len("optim."):].rpartition(".")
            state_keys.setdefault(param, []).append(key)
    for group in opt.param_groups:
        # lr, betas, eps and weight_decay stay the recipe's: its settings apply on resume (the worker
        # names each one that differs from the checkpoint's, see optim_changes)
        for p in group["params"]:
            name = names[id(p)]
            keys = state_keys.get(name)
            if not keys and (halves := separate_gate_up_names(name)):  # gate and up saved apart (TensorSource)
                keys = state_keys.get(halves[0])
            if not keys:  # saved before the first optimizer step
                continue
            own = expert_shard_ownership(p, run.layout) if id(p) in shard_ids else ownership(name, p, run.layout)
            entry = {}
            for key in keys:
                if source.shape(f"optim.{name}.{key}") == ():
                    value = source.full(f"optim.{name}.{key}").clone()
                    if group.get("fused") or group.get("capturable"):  # torch keeps these steps on the device
                        value = value.to(device=local_tensor(p).device, dtype=torch.float32)
                else:  # in the run's moment dtype (optim.state_dtype), whatever the checkpoint's: read_into casts
                    moments = key in ("exp_avg", "exp_avg_sq") and hasattr(opt, "moment_dtype")
                    dtype = opt.moment_dtype(p) if moments else p.dtype
                    value = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    source.read_into(f"optim.{name}.{key}", own.offset, own.rows, local_tensor(value))
                entry[key] = value
            opt.state[p] = entry
    sched = run.scheduler
    sched.load_state_dict(state["scheduler"])
    sched.base_lrs = [group["initial_lr"] for group in opt.param_groups]  # optim.lr of the recipe
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        group["lr"] = base * factor(sched.last_epoch)  # LambdaLR's own formula: bitwise when unchanged
    sched._last_lr = [group["lr"] for group in opt.param_groups]


def optim_changes(state: dict[str, Any], optim: OptimConfig) -> list[str]:
    """The optim.* settings that differ between a checkpoint's train state and `optim` ("key saved -> now")."""
    now = to_dict(optim)
    saved = state.get("optim")
    if saved is None:  # a checkpoint from before the optim section was saved: its decay group has the values
        group = next(g for g in state["param_groups"] if g["name"] in ("decay", "experts", "no_decay"))
        saved = {"lr": group["initial_lr"], "beta1": group["betas"][0], "beta2": group["betas"][1],
                 "eps": group["eps"]}
        if group["name"] != "no_decay":
            saved["weight_decay"] = group["weight_decay"]
    # the schedule's span has its own note, with the lr it moves (trainer.worker.schedule_change)
    return [f"optim.{k} {saved[k]!r} -> {now[k]!r}" for k in sorted(saved)
            if k in now and saved[k] != now[k] and k != "schedule_steps"]


# ---------------------------------------------------------------------------------------------- find
def is_complete(path: Path) -> bool:
    """Cheap validity: the final name, a valid manifest (manifest.read_manifest), and every listed file at its
    size."""
    if path.name.endswith(_TMP):
        return False
    try:
        files = read_manifest(path / MANIFEST)["files"]
    except CheckpointError:
        return False
    return all((path / f).is_file() and (path / f).stat().st_size == e["bytes"] for f, e in files.items())


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob(f"{_PREFIX}*"):
        step = path.name[len(_PREFIX):]
        if path.is_dir() and step.isdigit() and is_complete(path):
            found.append((int(step), path))
    return [p for _, p in sorted(found)]


def incomplete_after(root: str | Path, chosen: Path | None) -> list[Path]:
    """Checkpoint directories newer than `chosen` (all, if None) that are not complete: interrupted saves
    (`.tmp`) and damaged checkpoints, which `resume: auto` passes over."""
    root = Path(root)
    if not root.is_dir():
        return []
    after = int(chosen.name[len(_PREFIX):]) if chosen is not None else -1
    out = []
    for path in root.glob(f"{_PREFIX}*"):
        step = path.name[len(_PREFIX):].removesuffix(_TMP)
        if path.is_dir() and step.isdigit() and int(step) > after and not is_complete(path):
            out.append((int(step), path))
    return [p for _, p in sorted(out)]


def find_latest(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def _soundness(found: list[Path]) -> list[bool]:
    """For each complete checkpoint: finite, and its largest |weight| at most MAX_GROWTH times the oldest one's
    that records it. "finite" alone promises no nan / inf, not sane values: a huge learning rate leaves finite
    weights of 1e4 and more."""
    manifests = [read_manifest(p / MANIFEST) for p in found]
    reference = next((m["max_abs"] for m in manifests if m.get("max_abs") is not None), None)
    return [m.get("finite", True) and (reference is None or m.get("max_abs") is None
                                       or m["max_abs"] <= MAX_GROWTH * reference)
            for m in manifests]


def prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest keep_last, except the newest sound one (finite and not
    blown up, _soundness: a run that diverged keeps the checkpoint to resume from), and the debris of
    interrupted deletions.

    A deletion first renames the directory to `<name>.tmp` (atomic), so a kill during rmtree leaves a
    `.tmp` directory, which the next save removes, never a half-deleted checkpoint under its final name."""
    found = list_checkpoints(root)
    keep = set(found[-keep_last:])
    keep.update([p for p, sound in zip(found, _soundness(found), strict=True) if sound][-1:])
    newest = found[-1] if found else None
    for path in root.glob(f"{_PREFIX}*"):
        step = path.name[len(_PREFIX):]
        if not (path.is_dir() and step.isdigit()) or path in keep:
            continue
        # complete and old, or a final-named directory without a complete manifest older than the newest
        # checkpoint: only an interrupted deletion leaves one (saves rename a finished .tmp into place)
        if path in found or (newest is not None and int(step) < int(newest.name[len(_PREFIX):])):
            doomed = path.with_name(path.name + _TMP)
            if doomed.exists():
                shutil.rmtree(doomed)
            os.replace(path, doomed)
            shutil.rmtree(doomed)


# ---------------------------------------------------------------------------------------------- io
def _write_durable(path: Path, data: bytes) -> None:
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_file(path: Path) -> None:
    with path.open("rb+") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(run: TrainState) -> None:
    if run.layout.distributed:
        dist.barrier(group=run.layout.world_group)


def _gather(run: TrainState, obj: Any) -> list[Any]:
    if not run.layout.distributed:
        return [obj]
    out: list[Any] = [None] * run.layout.world_size
    dist.all_gather_object(out, obj, group=run.layout.world_group)
    return out
