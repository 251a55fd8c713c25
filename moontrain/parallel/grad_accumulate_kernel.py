"""acc_i += g_i for a list of fp32 accumulators and their compute-dtype grads in one Triton launch: the later
passes of parallel.dense=plain on CUDA (parallel.plain_accumulate=auto, the default, or triton).

Legend: n tensors, P programs (a chunk of BLOCK elements of one tensor each).

Value: each grad element widened to fp32 (exact) and added to its accumulator in fp32, rounded once: what the
PyTorch path (moontrain.parallel.plain_dense: a foreach copy into an fp32 scratch, then a foreach add) computes,
bit for bit. Traffic: the grad read once and the accumulator read and written once, 10 bytes an element at bf16,
against 18 through the scratch (a widened copy written and read again).

Launch: one program per chunk. The chunk table ([P, 2] int64: tensor index, first element) and the sizes depend
on the list of sizes only and stay on the device; the tensors' addresses ([n, 2] int64: accumulator, grad) change
every pass (autograd makes new grads) and go to the device per call from pinned host memory, without a sync.
The program loads its tensor's two addresses and casts them to pointers.

Rejected: torch._foreach_add_ of fp32 and bf16 lists (mixed dtypes take torch's per-tensor path: one kernel per
parameter and pass); a grid of n x max chunks (the embedding's 335 M elements against a norm's 2,048: most
programs would exit at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program adds (fp32 accumulator 16 KiB, bf16 grad 8 KiB)
NUM_WARPS = 4
GRAD_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _accumulate_kernel(chunks_ptr, addrs_ptr, numels_ptr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(chunks_ptr + 2 * pid + 1), BLOCK)
    n = tl.load(numels_ptr + t)
    # 16-byte aligned (_validate): vector loads and stores
    acc = tl.multiple_of(tl.load(addrs_ptr + 2 * t).to(tl.pointer_type(tl.float32)), 16)
    grad = tl.multiple_of(tl.load(addrs_ptr + 2 * t + 1).to(tl.pointer_type(GRAD)), 16)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:  # a whole chunk: unmasked, so vectorised (n is data here, of unknown divisibility)
        tl.store(acc + offs, tl.load(acc + offs) + tl.load(grad + offs).to(tl.float32))
    else:  # the tensor's last chunk
        mask = offs < n
        total = tl.load(acc + offs, mask=mask) + tl.load(grad + offs, mask=mask).to(tl.float32)
        tl.store(acc + offs, total, mask=mask)


def chunk_table(numels: list[int], block: int = BLOCK) -> torch.Tensor:
    """[P, 2] int64 (tensor index, first element) of every BLOCK-element chunk of tensors of these sizes, in
    order (on the CPU)."""
    rows = [(t, start) for t, n in enumerate(numels) for start in range(0, n, block)]
    return torch.tensor(rows, dtype=torch.int64).view(-1, 2)


class GradAccumulator:
    """add_(accs, grads): accs[i] += grads[i] (module docstring) in one launch; the chunk table of each list of
    sizes made once and kept on the device."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def add_(self, accs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        if not accs:
            return
        _validate(accs, grads)
        device = accs[0].device
        key = tuple(a.numel() for a in accs)
        if key not in self._tables:
            self._tables[key] = (chunk_table(list(key), BLOCK).to(device),
                                 torch.tensor(key, dtype=torch.int64, device=device))
        chunks, numels = self._tables[key]
        addrs = torch.tensor([[a.data_ptr(), g.data_ptr()] for a, g in zip(accs, grads, strict=True)],
                             dtype=torch.int64, pin_memory=device.type == "cuda")
        addrs = addrs.to(device, non_blocking=True)
        _accumulate_kernel[(chunks.shape[0],)](chunks, addrs, numels, GRAD=GRAD_DTYPES[grads[0].dtype], BLOCK=BLOCK,
                                               num_warps=NUM_WARPS)


def _validate(accs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if len(accs) != len(grads):
        raise ValueError(f"grad_accumulate: {len(accs)} accumulators but {len(grads)} grads; pass one grad each")
    dtypes = {g.dtype for g in grads}
    if len(dtypes) != 1 or next(iter(dtypes)) not in GRAD_DTYPES:
        raise ValueError(f"grad_accumulate: the grads must share one dtype of {sorted(map(str, GRAD_DTYPES))}, got "
                         f"{sorted(map(str, dtypes))}; accumulate each dtype's list apart")
    devices = {t.device for t in (*accs, *grads)}
    if len(devices) != 1:
        raise ValueError(f"grad_accumulate: tensors on {sorted(map(str, devices))}; put them on one device")
    misaligned = [i for i, (a, g) in enumerate(zip(accs, grads, strict=True)) if (a.data_ptr() | g.data_ptr()) % 16]
    if misaligned:
        raise ValueError(f"grad_accumulate: pairs {misaligned[:8]} start off a 16-byte boundary (the kernel's vector "
                         "loads need it); pass whole tensors, not views at an odd offset")
    for i, (a, g) in enumerate(zip(accs, grads, strict=True)):
        if a.dtype != torch.float32 or not a.is_contiguous() or not g.is_contiguous() or a.shape != g.shape:
            raise ValueError(f"grad_accumulate: pair {i}: accumulator {a.dtype} {tuple(a.shape)} (contiguous "
                             f"{a.is_contiguous()}), grad {tuple(g.shape)} (contiguous {g.is_contiguous()}); the "
                             "accumulators are fp32 and both are contiguous, of one shape")
