"""Expert-load heatmap: per MoE layer (rows, first layer on top) x per expert (columns), the share of the
layer's routed tokens an expert received over the last heatmap window, as a PNG (and a wandb image).

Legend: L MoE layers, E experts.

Colour: the load relative to the uniform share 1/E (so 1 is perfect balance, and the brightest cell of a
row is that layer's maxvio + 1), on a dark-blue -> teal -> yellow ramp clipped at 3x uniform. The image has
no text: rows are the MoE layers in model order, columns the expert ids 0..E-1. The counts are the
routers' world-reduced token counts, on the device every step; they are summed on the device and read
once per heatmap.

The PNG writer is a few lines over zlib (8-bit RGB, no filter), so no plotting package is needed.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from moontrain.metrics.host_read import HostRead

CELL_PX = 12  # each (layer, expert) cell is a square of this many pixels (fewer for very many experts)
MAX_WIDTH_PX = 2048
CLIP = 3.0  # loads at or above this multiple of the uniform share get the brightest colour
_RAMP = np.array([[13, 8, 135], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)  # dark -> bright


class ExpertLoad:
    """Sums the world-reduced token counts [L, E] of every step on the device; `launch()` sends them to the host and restarts."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)

    def add(self, counts_LE: torch.Tensor) -> None:
        if counts_LE.numel():
            self.counts_LE += counts_LE

    def launch(self) -> HostRead:
        """The counts so far on their way to the host (moontrain.metrics.host_read); the sums restart."""
        pending = HostRead(self.counts_LE.clone())
        self.counts_LE.zero_()
        return pending

    @staticmethod
    def share(pending: HostRead) -> np.ndarray:
        """launch's counts read as each layer's share of its routed tokens ([L, E], rows sum to 1; zeros
        before any step)."""
        counts = np.array(pending.read(), dtype=np.float64).reshape(pending.host.shape)
        total = counts.sum(axis=1, keepdims=True)
        return np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)


def colorize(share_LE: np.ndarray) -> np.ndarray:
    """[L * px, E * px, 3] uint8 image of the load relative to uniform (see the module docstring)."""
    E = share_LE.shape[1]
    rel = np.clip(share_LE * E / CLIP, 0.0, 1.0)  # 0 .. 1 over 0 .. CLIP x uniform
    pos = rel * (len(_RAMP) - 1)
    lo = np.minimum(pos.astype(np.int64), len(_RAMP) - 2)
    frac = (pos - lo)[..., None]
    rgb = (_RAMP[lo] * (1 - frac) + _RAMP[lo + 1] * frac).round().astype(np.uint8)
    px = max(1, min(CELL_PX, MAX_WIDTH_PX // max(E, 1)))
    return rgb.repeat(px, axis=0).repeat(px, axis=1)


def write_png(path: str | Path, rgb_HW3: np.ndarray) -> Path:
    """An 8-bit RGB PNG (every scanline with filter type 0)."""
    height, width, channels = rgb_HW3.shape
    assert channels == 3 and rgb_HW3.dtype == np.uint8
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rgb_HW3.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + \
        chunk(b"IEND", b"")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".png.tmp")
    tmp.write_bytes(png)
    tmp.replace(path)
    return path


def read_png(path: str | Path) -> np.ndarray:
    """[H, W, 3] uint8 of a PNG written by write_png (for tests and quick checks)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * 3)
    assert not raw[:, 0].any(), "only filter type 0 is read"
    return raw[:, 1:].reshape(height, width, 3).copy()


def heatmap_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "heatmaps" / f"expert_load_step_{step:08d}.png"
