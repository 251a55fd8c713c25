"""KDA's gate-and-norm kernels (kernels.kda_gate_norm=moontrain, moontrain.model.kda.gate_norm_kernel) on one GPU
over their launch's warps, at the recipe's KDA call: B x T tokens, 16 heads of 128, bf16 q / k / f read in place as
column slices of one projection (as the layer hands them over), with and without packed documents.

    python benchmarks/bench_gate_norm.py [--case 4x4096x16] [--doc-len 1024] [--warps 4 8 16] [--iters 20]
        [--warmup 3] [--out FILE]

Why warps: one program holds a [64, 128] tile of each tensor it reads, so the warps set the registers a thread
needs and through them the programs an SM holds (benchmarks/diagnostics/kernel_registers.py: at 4 warps the
forward takes 167 registers, the backward 255 with a spill; at 8 warps 80 and 128). Per row: the median
device ms of the forward and of the backward (CUDA events, the host run ahead), the HBM bytes each must move
(forward: q, k, f read, qn, kn, g written; backward: dq, dk, dg fp32 and qn, kn, f read, dq_in, dk_in, df
written) and the rate that makes, and the largest difference from the first --warps value's outputs relative to
each output's largest magnitude (the warps change the order of the rows' sums, within the bound the kernel
tests derive). Documents: B = 1, T = B x T tokens, a document every --doc-len tokens (fla's varlen form).
A table is printed; --out writes JSON. GPU only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import ONE_CALL_AHEAD_MS, kernel_bench_args, median_ms
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.gate_norm_kernel import kda_gate_norm, kda_gate_norm_backward

K = 128
LOWER_BOUND = -5.0
DEVICE = "cuda"  # the CPU runs this module only under Triton's interpreter, to check its logic


def _inputs(B: int, T: int, H: int, doc_len: int | None) -> tuple[dict, dict]:
    """(forward keyword arguments, the backward's incoming gradients) at the recipe's scales."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    if doc_len is not None:
        B, T = 1, B * T
    proj = torch.randn(B, T, 3 * H * K + 64, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    q, k, f = (proj[..., i * H * K:(i + 1) * H * K].view(B, T, H, K) for i in range(3))
    fwd = dict(q=q, k=k, f=f, A_log=torch.empty(H, device=DEVICE).uniform_(1, 16, generator=gen).log(),
               dt_bias=torch.randn(H * K, device=DEVICE, generator=gen) - 4, lower_bound=LOWER_BOUND)
    if doc_len is not None:
        cu = torch.arange(0, T + 1, doc_len, device=DEVICE)
        cu = torch.cat([cu, cu.new_tensor([T])]) if cu[-1] != T else cu
        fwd |= dict(cu_seqlens=cu, chunk_indices=prepare_chunk_indices(cu))
    grads = {n: torch.randn(B, T, H, K, device=DEVICE, generator=gen) for n in ("dq", "dk", "dg")}
    return fwd, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def run_case(B: int, T: int, H: int, doc_len: int | None, warps_list: list[int], iters: int, warmup: int) -> list:
    fwd, grads = _inputs(B, T, H, doc_len)
    n = fwd["q"].numel()
    fwd_gb, bwd_gb = (3 * 2 + 2 * 2 + 4) * n / 1e9, (3 * 4 + 3 * 2 + 3 * 2) * n / 1e9
    rows, first = [], None
    for warps in warps_list:
        qn, q_rstd, kn, k_rstd, g = kda_gate_norm(**fwd, warps=warps)
        bwd = dict(grads, qn=qn, q_rstd=q_rstd, kn=kn, k_rstd=k_rstd, f=fwd["f"], A_log=fwd["A_log"],
                   dt_bias=fwd["dt_bias"], lower_bound=LOWER_BOUND, cu_seqlens=fwd.get("cu_seqlens"),
                   chunk_indices=fwd.get("chunk_indices"))
        outs = (qn, q_rstd, kn, k_rstd, g, *kda_gate_norm_backward(**bwd, warps=warps))
        first = first or outs
        fwd_ms = median_ms(lambda: kda_gate_norm(**fwd, warps=warps),  # noqa: B023
                           iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
        bwd_ms = median_ms(lambda: kda_gate_norm_backward(**bwd, warps=warps),  # noqa: B023
                           iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
        rows.append(dict(case=f"{B}x{T}x{H}", documents=doc_len, warps=warps, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                         fwd_gb=fwd_gb, bwd_gb=bwd_gb, fwd_tbs=fwd_gb / fwd_ms, bwd_tbs=bwd_gb / bwd_ms,
                         max_rel_diff=max(_rel(a, b) for a, b in zip(outs, first, strict=True))))
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_gate_norm",
                             case=dict(default="4x4096x16", help="BxTxH (KDA heads of 128)"),
                             **{"doc-len": dict(type=int, default=1024)},
                             warps=dict(type=int, nargs="+", default=[4, 8, 16]))
    B, T, H = (int(v) for v in args.case.split("x"))
    rows = []
    for doc_len in (None, args.doc_len):
        rows += run_case(B, T, H, doc_len, args.warps, args.iters, args.warmup)
    print(f"{'case':>12} {'docs':>5} {'warps':>5} | {'fwd ms':>7} {'TB/s':>5} | {'bwd ms':>7} {'TB/s':>5} | rel diff")
    for r in rows:
        print(f"{r['case']:>12} {r['documents'] or '-':>5} {r['warps']:5d} | {r['fwd_ms']:7.3f} {r['fwd_tbs']:5.2f} | "
              f"{r['bwd_ms']:7.3f} {r['bwd_tbs']:5.2f} | {r['max_rel_diff']:.2g}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
