"""Before any worker starts: what the run directory's checkpoint says about the launch.

With checkpoint.resume=auto (or a checkpoint path) a launch continues the run its checkpoint belongs to.
What that checkpoint cannot continue under the new settings is refused here, in one line naming what
differs and the two ways out (another train.run_dir, or checkpoint.resume=none), instead of in every
worker half a minute later: another model (any model.* key: the weights' shapes and meaning), another
optimizer (optim.name: its state does not carry over), another data source kind (data.source: the data
position) or another tokenizer (the ids mean other text). A run already at train.steps is finished: the
launcher says so and starts nothing. Only the checkpoint's train_state.json is read (its sha256 checked
against the manifest): the workers verify every file before they load (moontrain.checkpoint.resume) and
pass over a damaged newest checkpoint for an older one of the same run, whose settings are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moontrain.checkpoint.store import find_latest, open_checkpoint
from moontrain.config.loader import to_dict
from moontrain.config.run_config import RunConfig
from moontrain.data.tokenizer import tokenizer_digest
from moontrain.model.config import saved_model_dict


@dataclass(frozen=True, slots=True)
class Resume:
    checkpoint: Path
    step: int


def checkpoint_dir(cfg: RunConfig) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")


def check_resume(cfg: RunConfig) -> Resume | None:
    """The checkpoint a launch will continue (None: a fresh start); raises ValueError when it cannot."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    path = find_latest(checkpoint_dir(cfg)) if resume == "auto" else Path(resume)
    if path is None:
        return None
    if not path.is_dir():
        raise ValueError(f"checkpoint.resume={resume!r} is not a directory; use none, auto or a checkpoint path "
                         f"such as {checkpoint_dir(cfg)}/step_00000100")
    state, _ = open_checkpoint(path)
    step = state["step"]
    differs = _differences(state, cfg)
    if differs:
        raise ValueError(f"{cfg.train.run_dir} holds a run at step {step} ({path}) that these settings cannot "
                         f"continue: {', '.join(differs)}; start a new run with another train.run_dir=..., or set "
                         "checkpoint.resume=none to start over here (the earlier checkpoints are moved aside)")
    if step > cfg.train.steps:
        raise ValueError(f"checkpoint {path} is at step {step}, past train.steps={cfg.train.steps}: raise "
                         f"train.steps above {step} to train on, or set checkpoint.resume=none to start afresh")
    return Resume(path, step)


def _differences(state: dict, cfg: RunConfig) -> list[str]:
    """'key saved -> now' for what the checkpoint cannot continue under `cfg`."""
    saved_model, model = saved_model_dict(state["model"]), to_dict(cfg.model)
    out = [f"model.{k} {saved_model.get(k)!r} -> {model.get(k)!r}"
           for k in sorted(set(saved_model) | set(model)) if saved_model.get(k) != model.get(k)]
    saved_optim = (state["optim"]["name"] if "optim" in state else  # older: Muon's groups are named adamw, muon
                   "muon" if any(g["name"] == "muon" for g in state["param_groups"]) else "adamw")
    if saved_optim != cfg.optim.name:
        out.append(f"optim.name {saved_optim} -> {cfg.optim.name}")
    if state["data_source"] != cfg.data.source:
        out.append(f"data.source {state['data_source']} -> {cfg.data.source}")
    elif "tokenizer" in state and state["tokenizer"] is not None and not _same_tokenizer(state["tokenizer"], cfg):
        out.append(f"data.tokenizer {state['tokenizer']['spec']} -> {cfg.data.tokenizer}")
    return out


def _same_tokenizer(record: dict, cfg: RunConfig) -> bool:
    spec = cfg.data.tokenizer
    if record["spec"] == "bytes" or spec == "bytes":
        return record["spec"] == spec
    return not Path(spec).exists() or tokenizer_digest(spec) == record.get("sha256")
