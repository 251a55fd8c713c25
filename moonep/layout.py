"""Layout: the one object that owns every size and offset in moonep's symmetric memory.

Per rank there is one *comm* segment (receive rows, combine rows, metadata) and, per expert
projection, a weight segment per layer ([epn, in, out] in `dtype`), a grad segment per layer
([epn, in, out] fp32), one slot pool ([B, in, out] in `dtype`) and one reduce pool ([B, in, out]
fp32) shared by all layers. Views are assembled from these by `moonep.pools` and `moonep.buffer`.

Every region holds what the planner can use (docs/moonep.md §4.2): a rank computes at most `remote_experts`
experts of other ranks, epn at R > 1 (§5.2) and none at R = 1; B defaults to that (no slot or reduce pool
on one rank), and the receive rows hold epn + remote_experts padded groups.

Comm segment regions (rows are token rows of width H):
    recv        [NvS + 2, H] dtype   dispatch destination; row NvS is a trash row for masked-out
                                     writes, row NvS + 1 stays zero (source of padding rows)
    comb        [NvS + 2, H] dtype   combine source rows (y_rows), read by the home ranks ("source" only)
    hist        [R, E]       int32   every rank's tokens_per_expert, written by that rank
    row_weight  [NvS + 1]    fp32    route weight per received row (trash at NvS)
    row_link    [NvS + 1, 2] int32   per received row (row_copy, row_src), one 8-byte record so the
                                     scatter sends both with one store (views row_copy / row_src):
                row_copy             row to copy from: itself, a duplicate's primary row, or the
                                     zero row for padding
                row_src              source of the row: src_rank * S * K + t * K + k
    row_chain   [NvS + 1]    int32   per received row 2 * next + primary (combine_reduce
                                     "destination", triton path): next is the row of the same
                                     token's next entry (ascending k) on this rank, -1 at the end;
                                     primary 1 on the token's first entry here (the sent row)
    row_scalar  [NvS + 1]    fp32    per-row scalars read back by the sources (route-weight grads)
    land        [S*K + 1, H] dtype   combine landing rows of this rank's entries t*K + k, pushed by
                                     the destinations (triton path, moonep.kernels.dispatch_combine;
                                     both paths with combine_reduce "destination": a partial row in
                                     the landing row of its first entry); row S*K takes the PyTorch
                                     path's masked-out writes
    land_scalar [S*K + 1]    fp32    row scalars of the same entries (where land is used)

NvS = round_up(S*K + (epn + remote_experts)*(token_padding - 1), token_padding) (`receive_rows`):
every rank receives exactly cap_d <= S*K rows in at most epn + remote_experts non-empty groups (its
epn local experts plus, at R > 1, at most epn experts of one remote home group), each padded by at
most token_padding - 1 rows.

`Layout(config, R)` needs no process group or memory: a dry run sizes a job with it (`heap_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moonep.config import BufferConfig

_ALIGN = 256  # bytes; every region starts on a 256-byte boundary (vector loads, TMA)


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class Region:
    offset: int  # bytes from the start of the segment
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = dtype_bytes(self.dtype)
        for d in self.shape:
            n *= d
        return n


def remote_experts(num_experts: int, num_ranks: int) -> int:
    """The most experts of other ranks the planner gives one rank to compute: epn when R > 1 (a
    receiver takes tokens from one remote home group at most, §5.2), none on one rank."""
    return num_experts // num_ranks if num_ranks > 1 else 0


def receive_rows(max_tokens: int, topk: int, num_experts: int, num_ranks: int, token_padding: int) -> int:
    """NvS: receive rows per rank, enough for any routing of max_tokens tokens per rank."""
    groups = num_experts // num_ranks + remote_experts(num_experts, num_ranks)
    return round_up(max_tokens * topk + groups * (token_padding - 1), token_padding)


@dataclass(frozen=True, slots=True)
class Layout:
    """Sizes and offsets of one Buffer's symmetric memory on each of `num_ranks` ranks; `granularity`
    (bytes) is the heap's mapping granularity (1: unrounded sizes, for estimates)."""

    config: BufferConfig
    num_ranks: int
    granularity: int = 1
    epn: int = field(init=False)
    remote_experts: int = field(init=False)
    num_slots: int = field(init=False)
    nvs: int = field(init=False)
    comm: dict[str, Region] = field(init=False)
    comm_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        cfg, R = self.config, self.num_ranks
        if cfg.num_experts % R:
            raise ValueError(
                f"num_experts={cfg.num_experts} is not divisible by the EP group size R={R}; "
                f"use a multiple of {R} experts or another group size"
            )
        epn = cfg.num_experts // R
        remote = remote_experts(cfg.num_experts, R)
        num_slots = remote if cfg.num_slots is None else cfg.num_slots
        nvs = receive_rows(cfg.max_tokens, cfg.topk, cfg.num_experts, R, cfg.token_padding)
        H, E = cfg.hidden, cfg.num_experts
        # combine_reduce "destination" pushes partial rows from the caller's tensor into the landing rows:
        # no comb region (Buffer.combine_input is for "source")
        comb = [("comb", (nvs + 2, H), cfg.dtype)] if cfg.options.combine_reduce == "source" else []
        specs = [
            ("recv", (nvs + 2, H), cfg.dtype),
            *comb,
            ("hist", (R, E), torch.int32),
            ("row_weight", (nvs + 1,), torch.float32),
            ("row_link", (nvs + 1, 2), torch.int32),
            ("row_chain", (nvs + 1,), torch.int32),
            ("row_scalar", (nvs + 1,), torch.float32),
            ("land", (cfg.max_tokens * cfg.topk + 1, H), cfg.dtype),
            ("land_scalar", (cfg.max_tokens * cfg.topk + 1,), torch.float32),
        ]
        regions: dict[str, Region] = {}
        offset = 0
        for name, shape, dtype in specs:
            regions[name] = Region(offset, shape, dtype)
            offset = round_up(offset + regions[name].nbytes, _ALIGN)
        object.__setattr__(self, "epn", epn)
        object.__setattr__(self, "remote_experts", remote)
        object.__setattr__(self, "num_slots", num_slots)
        object.__setattr__(self, "nvs", nvs)
        object.__setattr__(self, "comm", regions)
        object.__setattr__(self, "comm_bytes", round_up(offset, self.granularity))

    @property
    def trash_row(self) -> int:
        return self.nvs

    @property
    def zero_row(self) -> int:
        return self.nvs + 1

    def nvs_rows(self, max_cap: int) -> int:
        """Rows a call may fill when no rank receives more than `max_cap` token slots."""
        pad = self.config.token_padding
        return round_up(max_cap + (self.epn + self.remote_experts) * (pad - 1), pad)

    def call_rows(self, num_tokens: int, total_num_tokens: int | None) -> int:
        """nvs_s of a call with s = num_tokens on this rank (and total_num_tokens over the ranks when
        they differ): receive caps are s*K, or total*K split evenly (docs/moonep.md §5.1)."""
        K = self.config.topk
        max_cap = num_tokens * K if total_num_tokens is None else -(-total_num_tokens * K // self.num_ranks)
        return self.nvs_rows(max_cap)

    def heap_bytes(self, projections: dict[str, tuple[int, int]], num_layers: int,
                   dtype: torch.dtype | None = None) -> dict[str, int]:
        """Bytes per rank of each symmetric-heap region of this Buffer and ExpertPools over `projections`
        with `num_layers` layers (weights and slots in `dtype`, default the config's; grads fp32):
        comm (the comm segment), weights and grads (epn rows per layer), slot_pool and reduce_pool
        (B rows, shared by the layers; none when B = 0)."""
        per_row = sum(i * o for i, o in projections.values())
        w, g = dtype_bytes(dtype or self.config.dtype), dtype_bytes(torch.float32)
        return {"comm": self.comm_bytes, "weights": num_layers * self.epn * per_row * w,
                "grads": num_layers * self.epn * per_row * g, "slot_pool": self.num_slots * per_row * w,
                "reduce_pool": self.num_slots * per_row * g}

    def expert_block_bytes(self, shape: tuple[int, int], dtype: torch.dtype, num_rows: int) -> int:
        """Bytes of `num_rows` expert matrices of `shape`; must be a multiple of the granularity."""
        nbytes = num_rows * shape[0] * shape[1] * dtype_bytes(dtype)
        if nbytes % self.granularity:
            raise ValueError(
                f"{num_rows} expert rows of shape {shape} in {dtype} take {nbytes} bytes, not a multiple "
                f"of the symmetric-heap granularity {self.granularity} bytes, so W_full cannot be "
                f"contiguous; choose hidden/intermediate sizes whose product times {dtype_bytes(dtype)} "
                f"bytes is a multiple of {self.granularity} (e.g. scale H' to a multiple of "
                f"{self.granularity // math.gcd(self.granularity, shape[0] * dtype_bytes(dtype))}), or change "
                "epn/num_slots"
            )
        return nbytes
