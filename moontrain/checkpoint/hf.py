"""Export to and import from a Hugging Face model directory (weights only).

    <dir>/config.json                       see hf_config.py (DeepSeek-V3 / Kimi K2 names + moontrain's)
    <dir>/model-0000i-of-0000n.safetensors  shards of at most `shard_bytes` (one tensor may exceed it)
    <dir>/model.safetensors.index.json      {"metadata": {"total_size"}, "weight_map": {name: shard}}
    <dir>/configuration_moontrain.py, modeling_moontrain.py   the modeling code (trust_remote_code)
    <dir>/tokenizer.json, tokenizer_config.json   the run's tokenizer under the names Hugging Face reads
                                            (run_tokenizer.py); none for synthetic Markov tokens

Names and layouts: hf_names.py. Weights are cast to `dtype` (bf16 by default; float32 keeps every bit),
except the router weight and score-correction bias, which stay fp32 (routing runs in fp32).

Export streams: the shard plan and every file header come from the checkpoint's manifest (shapes only);
tensors are then read one at a time (expert projections one expert at a time, gate_up's expert once for
each of its gate and up halves; with pread, not mmap: safetensors_io.py) and written straight to their
shard, so the peak host memory is about one tensor (read + cast copy) whatever the model or shard size.

Import (`checkpoint.init_from=<dir>`) reads, on every rank, only the canonical rows that rank owns under
its own EP / DP layout, from any directory with these names: an export, or a DeepSeek-V3 / Kimi K2
checkpoint (hf_config.py lists what its config may hold). Optimizer state, RNG and data position are
not part of it: an imported model starts a new run.

    moontrain export runs/k3_tiny/checkpoints/step_00000060 exported/k3_tiny [--dtype float32]
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from moontrain.checkpoint.hf_config import architecture_diff, hf_config, model_config
from moontrain.checkpoint.hf_names import hf_name, rope_rows
from moontrain.checkpoint.manifest import plain_name
from moontrain.checkpoint.run_tokenizer import tokenizer_of_checkpoint, write_export_tokenizer
from moontrain.checkpoint.safetensors_io import SafetensorsReader, write_safetensors
from moontrain.checkpoint.store import MANIFEST, load_model_tensors, open_checkpoint
from moontrain.checkpoint.tensors import CheckpointError, TensorSource
from moontrain.dataclass_dict import from_dict
from moontrain.model.config import ModelConfig, saved_model_dict

if TYPE_CHECKING:
    from moontrain.checkpoint.state import TrainState

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MODELING_FILES = ("configuration_moontrain.py", "modeling_moontrain.py")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
FP32_ALWAYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


# ---------------------------------------------------------------------------------------------- export
def export_hf(checkpoint: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
              shard_bytes: int = 5 * 2**30, tokenizer: str | Path | None = None) -> Path:
    """Write the model of a checkpoint (any layout) as a Hugging Face model directory; returns it.
    `tokenizer`: a tokenizer.json, a directory of tokenizer files or `bytes` (default: the one the checkpoint
    records; one of another vocabulary size is refused)."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(DTYPES)}")
    state, source = open_checkpoint(checkpoint)
    cfg = from_dict(ModelConfig, saved_model_dict(state["model"]), "model")
    # refused before anything is written
    with_tokenizer = tokenizer_of_checkpoint(Path(checkpoint), state, None if tokenizer is None else str(tokenizer))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = list(_export_plan(cfg, source, DTYPES[dtype]))
    shards = _assign_shards(plan, shard_bytes)
    n = max(shards) + 1 if shards else 1
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for shard, file in enumerate(names):
        entries = [entry for entry, i in zip(plan, shards, strict=True) if i == shard]
        total += write_safetensors(out_dir / file, entries)
        weight_map.update(dict.fromkeys((entry[0] for entry in entries), file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    max_positions = _max_positions(Path(checkpoint), cfg)
    extra: dict[str, Any] = {"moontrain_step": state["step"]}
    if with_tokenizer is None:
        extra["moontrain_tokenizer"] = "none"
    else:
        spec, tok = with_tokenizer
        write_export_tokenizer(out_dir, spec, tok, max_length=max_positions)
        if spec == "bytes":
            extra["moontrain_tokenizer"] = "bytes"
    config = hf_config(cfg, dtype=dtype, max_position_embeddings=max_positions, extra=extra)
    (out_dir / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    modeling = Path(__file__).resolve().parents[1] / "hf"
    for file in MODELING_FILES:
        shutil.copyfile(modeling / file, out_dir / file)
    return out_dir


def _export_plan(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype
                 ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]]:
    """(HF name, shape, dtype, reader) of every exported tensor, in checkpoint order; nothing is read yet."""
    for key in source.names():
        if not key.startswith("model."):
            continue
        name = hf_name(key[len("model."):], cfg)
        shape = tuple(source.shape(key))
        out_dtype = torch.float32 if name.name.endswith(FP32_ALWAYS) else dtype
        if name.kind == "experts":
            width = shape[2] // len(name.parts)
            for j in range(shape[0]):
                for k, hf in enumerate(name.experts(j)):
                    yield (hf, (width, shape[1]), out_dtype,
                           lambda key=key, j=j, c=k * width, w=width, d=out_dtype:
                           source.rows(key, j, 1)[0, :, c:c + w].t().to(d).contiguous())
            continue
        order = rope_rows(name.kind, cfg, shape[0], to_hf=True) if shape else None

        def read(key: str = key, order: torch.Tensor | None = order, out_dtype: torch.dtype = out_dtype) -> torch.Tensor:
            t = source.full(key)
            return (t if order is None else t[order]).to(out_dtype).contiguous()

        yield name.name, shape, out_dtype, read


def _assign_shards(plan: list, shard_bytes: int) -> list[int]:
    shards, shard, used = [], 0, 0
    for _, shape, dtype, _ in plan:
        size = torch.Size(shape).numel() * dtype.itemsize
        if used and used + size > shard_bytes:
            shard, used = shard + 1, 0
        shards.append(shard)
        used += size
    return shards


def _run_config(checkpoint: Path) -> dict[str, Any] | None:
    """The resolved config.yaml of the run a checkpoint belongs to (<run_dir>/checkpoints/step_N), if there."""
    path = checkpoint.resolve().parent.parent / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _max_positions(checkpoint: Path, cfg: ModelConfig) -> int:
    if cfg.rope_yarn is not None:
        return int(cfg.rope_yarn.original_max_position * cfg.rope_yarn.factor)
    run = _run_config(checkpoint)
    return int(run["train"]["seq_len"]) if run else 4096


def describe_export(out_dir: Path) -> str:
    """One line: what an export directory holds (step, shards, dtype, size, tokenizer)."""
    config = json.loads((out_dir / CONFIG).read_text())
    index = json.loads((out_dir / INDEX).read_text())
    shards = len(set(index["weight_map"].values()))
    tokenizer = config.get("moontrain_tokenizer")
    if tokenizer == "none":
        tok = "no tokenizer (synthetic Markov tokens)"
    else:
        names = [f for f in ("tokenizer.json", "tokenizer_config.json") if (out_dir / f).is_file()]
        tok = " + ".join(names) + (" (the byte tokenizer)" if tokenizer == "bytes" else "")
    return (f"exported step {config.get('moontrain_step')} to {out_dir}: {shards} shard(s), {config.get('dtype')}, "
            f"{index['metadata']['total_size'] / 1e9:.3f} GB of weights; {tok}")


# ---------------------------------------------------------------------------------------------- import
class HFSource:
    """Canonical moontrain rows read from an HF model directory (the TensorSource interface that
    load_model_tensors uses): experts transposed back (gate_up's gate and up side by side) and stacked,
    rope rows de-interleaved, and FP8
    weights with block scales (`<name>_scale_inv`, the DeepSeek-V3 / Kimi K2 release format) dequantized
    to fp32: w = fp8 * scale_inv of the weight's [block_rows, block_cols] block."""

    def __init__(self, root: Path, cfg: ModelConfig, weight_map: dict[str, str], interleaved: bool,
                 fp8_block: tuple[int, int] = (128, 128)) -> None:
        self.root, self.cfg, self.weight_map, self.interleaved = root, cfg, weight_map, interleaved
        self.fp8_block = fp8_block
        self._open: dict[str, SafetensorsReader] = {}

    def _reader(self, hf: str) -> SafetensorsReader:
        if hf not in self.weight_map:
            raise CheckpointError(f"{self.root}: no tensor {hf!r} in the model directory; it does not match the model")
        file = self.weight_map[hf]
        if file not in self._open:
            try:
                self._open[file] = SafetensorsReader(self.root / file)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"model file {self.root / file} is not a readable safetensors file: {err}") from err
        return self._open[file]

    def _read(self, hf: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of an HF tensor (all of it by default), dequantized when it is stored in FP8."""
        reader = self._reader(hf)
        shape = reader.shape(hf)
        lo, hi = (0, shape[0] if shape else 0) if lo is None else (lo, hi)
        t = reader.rows(hf, lo, hi)
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        scale_name = hf + "_scale_inv"
        if scale_name not in self.weight_map or t.ndim != 2:
            raise CheckpointError(f"{self.root}: {hf} is stored in {t.dtype} without a 2-D block scale {scale_name!r}")
        br, bc = self.fp8_block
        scale = self._reader(scale_name).rows(scale_name, lo // br, -(-hi // br)).float()
        scale = scale.repeat_interleave(br, 0)[lo - lo // br * br:][:hi - lo].repeat_interleave(bc, 1)[:, :shape[1]]
        return t.float() * scale

    def shape(self, key: str) -> tuple[int, ...]:
        name = hf_name(key, self.cfg)
        if name.kind == "experts":
            shapes = [self._reader(hf).shape(hf) for hf in name.experts(0)]
            return (self.cfg.num_experts, shapes[0][1], sum(out_dim for out_dim, _ in shapes))
        return self._reader(name.name).shape(name.name)

    def full(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        return self.rows(key, 0, shape[0] if shape else 0)

    def rows(self, key: str, offset: int, rows: int) -> torch.Tensor:
        name = hf_name(key, self.cfg)
        if name.kind == "experts":
            if rows == 0:
                return torch.empty(0, *self.shape(key)[1:])
            return torch.stack([torch.cat([self._read(hf).t() for hf in name.experts(j)], dim=1)
                                for j in range(offset, offset + rows)])
        shape = self.shape(key)
        order = rope_rows(name.kind, self.cfg, shape[0], to_hf=False) if shape and self.interleaved else None
        if not shape:
            return self._read(name.name)
        if order is None:
            return self._read(name.name, offset, offset + rows)
        return self._read(name.name)[order[offset:offset + rows]]

    def read_into(self, key: str, offset: int, rows: int, out: torch.Tensor) -> None:
        out.copy_(self.rows(key, offset, rows))  # converted rows: built on the host, then copied


def read_hf(model_dir: str | Path) -> tuple[ModelConfig, HFSource]:
    """The model config and the weights (read on demand) of a Hugging Face model directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG
    if not config_path.is_file():
        raise CheckpointError(f"model file {config_path} is missing")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"model file {config_path} is corrupt: {err}") from err
    cfg = model_config(raw, str(config_path))
    if (model_dir / INDEX).is_file():
        weight_map = _weight_map(model_dir / INDEX)
    elif (model_dir / SINGLE).is_file():
        try:
            reader = SafetensorsReader(model_dir / SINGLE)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"model file {model_dir / SINGLE} is not a readable safetensors file: {err}") from err
        weight_map = dict.fromkeys(reader.keys(), SINGLE)
        reader.close()
    else:
        raise CheckpointError(f"{model_dir} holds neither {INDEX} nor {SINGLE}")
    for file in sorted(set(weight_map.values())):
        if not (model_dir / file).is_file():
            raise CheckpointError(f"model file {model_dir / file} is missing (named in {INDEX})")
    quant = raw.get("quantization_config") or {}
    if quant and (quant.get("quant_method") != "fp8" or len(quant.get("weight_block_size") or ()) != 2):
        raise CheckpointError(f"{config_path}: quantization_config {quant} is not supported (moontrain reads FP8 "
                              "with 2-D weight blocks, quant_method fp8)")
    block = tuple(quant["weight_block_size"]) if quant else (128, 128)
    return cfg, HFSource(model_dir, cfg, weight_map, interleaved=raw.get("rope_interleave", True), fp8_block=block)


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's {tensor name: shard file}, every shard a plain file name in the model directory: a name
    like `../x.safetensors` or `/etc/hostname` is refused before anything is opened."""
    try:
        weight_map = json.loads(index_path.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"model file {index_path} is not a JSON object with a weight_map: {err}") from err
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise CheckpointError(f"model file {index_path}: weight_map is not an object of tensor name -> shard file")
    bad = sorted({f for f in weight_map.values() if not plain_name(f)}, key=str)
    if bad:
        raise CheckpointError(f"model file {index_path}: weight_map names {len(bad)} shard(s) that are not plain file "
                              f"names inside {index_path.parent}, first {str(bad[0])[:200]!r}; shards must sit next "
                              "to the index (e.g. model-00001-of-00002.safetensors)")
    return weight_map


def import_hf(run: TrainState, model_dir: str | Path) -> None:
    """Load the weights of a Hugging Face model directory into a run whose model has the same
    architecture (any EP / DP layout; training settings such as init_std may differ)."""
    cfg, source = read_hf(model_dir)
    diff = architecture_diff(cfg, run.model_config)
    if diff:
        raise CheckpointError(f"{Path(model_dir) / CONFIG} describes another model than the recipe's model: section; "
                              "differing (imported vs recipe): " + ", ".join(diff))
    load_model_tensors(run, source, prefix="")


def init_weights_from(run: TrainState, path: str | Path) -> None:
    """checkpoint.init_from: the weights of a moontrain checkpoint (its manifest) or of an HF directory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        state, source = open_checkpoint(path)
        diff = architecture_diff(from_dict(ModelConfig, saved_model_dict(state["model"]), "model"), run.model_config)
        if diff:
            raise CheckpointError(f"checkpoint {path} holds another model than the recipe's model: section; "
                                  "differing (checkpoint vs recipe): " + ", ".join(diff))
        load_model_tensors(run, source, prefix="model.")
        return
    import_hf(run, path)


