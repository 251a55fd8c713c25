"""Registers and spills of the KDA backward's WY / inter-chunk stage per tile, from ptxas, without a GPU: fla's
chunk_kda_bwd_kernel_wy_dqkg_fused and moontrain.model.kda.dqkg_kernel's two kernels (and the intra-chunk
stage: fla's chunk_kda_bwd_kernel_intra over its autotune list; then the short convolution's kernels, dpre over
bench_short_conv's tiles and the walking backward over its spans; then the router's routing kernels and the
write-back AdamW kernel with fp32 and bf16 moments; then KDA's gate-and-norm kernels over 4 / 8 / 16 warps; then
the AttnRes aggregation's kernels), compiled by Triton for sm90 (H100 / H200) at k3_small's shape (16 heads, K = V = 128, chunk 64, bf16, no documents) and read back
with the ptxas Triton ships (`ptxas -v`).

    python benchmarks/diagnostics/kernel_registers.py        # fla's rows need fla-core importable

A spilled register is a store to and a load from local memory (L1 / L2) per use: at 255 registers and
kilobytes of spills per thread a kernel waits on those round trips, which is one hypothesis for a kernel
far from both its FLOP and its HBM bound. The table is evidence about code generation only; time it on
the GPU (benchmarks/bench_kda_bwd.py, benchmarks/bench_fla_tiles.py).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

SHAPE = dict(H=16, K=128, V=128, BT=64)
FLA_TILES = [(64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2)]  # BK, BV, warps, stages
KBLOCK_TILES = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2)]
FINISH_TILES = [(64, 4), (64, 8), (128, 8)]  # BV, warps (2 stages)
INTRA_TILES = [(w, s) for w in (1, 2, 4, 8) for s in (2, 3)]  # fla's list for its intra backward less its 4 stages


def jit_function(kernel):
    import triton

    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # under autotune / heuristics
        kernel = kernel.fn
    return kernel


def ptxas_report(kernel, pointers: dict[str, str], constants: dict, num_warps: int, num_stages: int) -> str:
    """Compile `kernel` for sm90 (arguments not named in pointers or constants are i32) and return ptxas's
    registers, spill stores and loads per thread, and Triton's shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(kernel)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    # pointers 16-byte aligned, as Triton's launcher specializes them for torch's allocations (without the
    # hint the loads are not vectorized and the registers differ from the kernel that runs)
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in pointers.items() if t.startswith("*") and n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()}, attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", log).group(1)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    return f"{regs:>4} regs  spill {stores:>5} B stored {loads:>5} B loaded  smem {compiled.metadata.shared:>6} B"


def main() -> None:
    from moontrain.model.kda import dqkg_kernel as ours

    print("kernel                         BK  BV warps stages")
    try:
        from fla.ops.kda import chunk_bwd as fla_bwd
    except ImportError:
        print("fla's kernel: fla-core not importable, skipped")
        fla_bwd = None
    if fla_bwd is not None:
        pointers = {n: "*bf16" for n in ("q", "k", "v", "v_new", "A", "h", "do", "dh", "dv", "dv2")}
        pointers |= {n: "*fp32" for n in ("g", "beta", "dq", "dk", "dg", "db", "dA", "scale")}
        pointers |= {"cu_seqlens": "*i64", "chunk_indices": "*i64", "scale": "fp32"}
        for bk, bv, w, s in FLA_TILES:
            consts = dict(SHAPE, HV=SHAPE["H"], BK=bk, BV=bv, STATE_V_FIRST=False, IS_VARLEN=False, USE_GRAPH=False)
            print(f"fla wy_dqkg_fused             {bk:3d} {bv:3d} {w:5d} {s:6d}  "
                  f"{ptxas_report(fla_bwd.chunk_kda_bwd_kernel_wy_dqkg_fused, pointers, consts, w, s)}", flush=True)
        from fla.ops.kda import chunk_intra  # its intra-chunk backward at the recipe's gate (safe, lower bound -5)

        pointers = {n: "*bf16" for n in ("q", "k")}
        pointers |= {n: "*fp32" for n in ("g", "beta", "dAqk", "dAkk", "dq", "dq2", "dk", "dk2", "dg", "dg2", "db")}
        pointers |= {"cu_seqlens": "*i64", "chunk_indices": "*i64"}
        consts = dict(H=SHAPE["H"], HV=SHAPE["H"], K=SHAPE["K"], BT=SHAPE["BT"], BC=16, BK=32, NC=4, IS_VARLEN=False,
                      SAFE_GATE=True, GATE_SHIFT=5.0 / math.log(2), USE_GATHER=False, USE_GRAPH=False)
        for w, s in INTRA_TILES:
            print(f"fla bwd_intra (BC 16)          32   - {w:5d} {s:6d}  "
                  f"{ptxas_report(chunk_intra.chunk_kda_bwd_kernel_intra, pointers, consts, w, s)}", flush=True)
    pointers = {n: "*bf16" for n in ("q", "k", "v_new", "A", "h", "do", "dh", "dv")}
    pointers |= {n: "*fp32" for n in ("g", "beta", "dq", "dk", "dg", "dA_part", "db_part")}
    pointers |= {"cu_seqlens": "*i64", "chunk_indices": "*i64", "scale": "fp32"}
    for bk, bv, w, s in KBLOCK_TILES:
        consts = dict(SHAPE, BK=bk, BV=bv, IS_VARLEN=False)
        print(f"moontrain _kblock_kernel      {bk:3d} {bv:3d} {w:5d} {s:6d}  "
              f"{ptxas_report(ours._kblock_kernel, pointers, consts, w, s)}", flush=True)
    pointers = {n: "*bf16" for n in ("v", "A", "dv", "dv2")}
    pointers |= {n: "*fp32" for n in ("beta", "db", "dA", "dA_part", "db_part")}
    pointers |= {"cu_seqlens": "*i64", "chunk_indices": "*i64"}
    for bv, w in FINISH_TILES:
        consts = dict(SHAPE, NK=2, BV=bv, IS_VARLEN=False)
        print(f"moontrain _finish_kernel        - {bv:3d} {w:5d} {2:6d}  "
              f"{ptxas_report(ours._finish_kernel, pointers, consts, w, 2)}", flush=True)
    short_conv_rows()
    router_and_write_back_rows()
    gate_norm_rows()
    attn_res_rows()


def router_and_write_back_rows() -> None:
    """The router's routing kernels (moontrain.model.router_kernel) at k3_small's 64 experts and K3's 384 with the
    tokens per program their launcher picks, and the write-back AdamW kernel with fp32 and bf16 moments."""
    import torch

    from moontrain.model import router_kernel as rk
    from moontrain.optim import write_back_kernel as wk

    print("kernel (router, top-8)          E  rows warps")
    fwd = {"logit_ptr": "*fp32", "bias_ptr": "*fp32", "skew_ptr": "*fp32", "weight_ptr": "*fp32",
           "topk_ptr": "*i64", "chosen_ptr": "*fp32", "count_ptr": "*i64", "scaling": "fp32"}
    bwd = {"grad_ptr": "*fp32", "chosen_ptr": "*fp32", "topk_ptr": "*i64", "split_ptr": "*bf16", "scaling": "fp32"}
    for E in (64, 384):
        meta = dict(rk._meta(E, 8), HW=True)
        print(f"moontrain _route_fwd_kernel   {E:4d} {meta['BS']:5d} {4:5d}  "
              f"{ptxas_report(rk._route_fwd_kernel, fwd, dict(meta, HAS_SKEW=False, COUNT=True), 4, 1)}", flush=True)
        print(f"moontrain _route_bwd_kernel   {E:4d} {meta['BS']:5d} {4:5d}  "
              f"{ptxas_report(rk._route_bwd_kernel, bwd, meta, 4, 1)}", flush=True)
    ptrs = {"ptrs_ptr": "*i64", "numel_ptr": "*i64", "first_ptr": "*i64", "owner_ptr": "*i32", "bc_ptr": "*fp32",
            "scale_ptr": "*fp32", "skip_ptr": "*fp32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32",
            "weight_decay": "fp32"}
    print("kernel (write-back AdamW)     moments  block warps")
    for bf16 in (False, True):
        block, warps = wk.TILE[torch.bfloat16 if bf16 else torch.float32]
        consts = dict(HAS_SCALE=True, HAS_SKIP=True, ZERO=False, OUT_KIND=1, STATE_BF16=bf16, BLOCK=block)
        print(f"moontrain _adamw_write_back   {'bf16' if bf16 else 'fp32':>7} {block:6d} {warps:5d}  "
              f"{ptxas_report(wk._adamw_write_back_kernel, ptrs, consts, warps, 1)}", flush=True)


def short_conv_rows() -> None:
    """KDA's short convolution kernels (moontrain.model.kda.short_conv_kernel) at their shipped tiles, and dpre
    at benchmarks/bench_short_conv.py's swept tiles, without and with documents."""
    from benchmarks.bench_short_conv import TILES
    from moontrain.model.kda import short_conv_kernel as conv

    ptrs = {n: "*bf16" for n in ("x_ptr", "dy_ptr", "dpre_ptr", "y_ptr", "dx_ptr")}
    ptrs |= {"w_ptr": "*fp32", "dw_part_ptr": "*fp32", "doc_ptr": "*i64"}
    print("kernel (short conv, W 4)      BT  BC warps   docs")
    shipped = [("_short_conv_fwd_kernel", conv.FWD_BLOCK_T, conv.FWD_BLOCK_C, conv.NUM_WARPS),
               ("_short_conv_dx_kernel", conv.FWD_BLOCK_T, conv.FWD_BLOCK_C, conv.NUM_WARPS)]
    shipped += [("_short_conv_dpre_kernel", bt, bc, w) for bt, bc, w in TILES]
    for name, bt, bc, w in shipped:
        for docs in (False, True):
            consts = dict(W=4, HAS_DOCS=docs, BLOCK_T=bt, BLOCK_C=bc)
            print(f"moontrain {name:24s} {bt:3d} {bc:3d} {w:5d} {docs!s:>6}  "
                  f"{ptxas_report(getattr(conv, name), ptrs, consts, w, 3)}", flush=True)
    from benchmarks.bench_short_conv import WALKS

    print("kernel (short conv walk, W 4) SPAN  BC warps   docs")
    for span, bc, w in WALKS:
        for docs in (False, True):
            consts = dict(W=4, HAS_DOCS=docs, SPAN=span, BLOCK_C=bc)
            print(f"moontrain _short_conv_bwd_walk   {span:3d} {bc:4d} {w:4d} {docs!s:>6}  "
                  f"{ptxas_report(conv._short_conv_bwd_walk_kernel, ptrs, consts, w, 3)}", flush=True)


def gate_norm_rows() -> None:
    """KDA's gate-and-norm kernels (moontrain.model.kda.gate_norm_kernel, kernels.kda_gate_norm) at k3_small's heads
    (the bounded gate, no documents) over 4, 8 and 16 warps: one program holds a [64, K] tile of each tensor it
    reads, so the warps set the registers a thread needs and, through them, the programs an SM holds."""
    from moontrain.model.kda import gate_norm_kernel as gn

    fwd = {n: "*bf16" for n in ("q", "k", "f", "qn", "kn")}
    fwd |= {n: "*fp32" for n in ("A_log", "dt_bias", "q_rstd", "k_rstd", "g")}
    fwd |= {"cu_seqlens": "*i64", "chunk_indices": "*i64", "lower_bound": "fp32", "eps": "fp32"}
    bwd = {n: "*fp32" for n in ("dq", "dk", "dg", "q_rstd", "k_rstd", "A_log", "dt_bias", "dA_part", "dbias_part")}
    bwd |= {n: "*bf16" for n in ("qn", "kn", "f", "dq_in", "dk_in", "df")}
    bwd |= {"cu_seqlens": "*i64", "chunk_indices": "*i64", "lower_bound": "fp32"}
    consts = dict(H=SHAPE["H"], K=SHAPE["K"], BT=SHAPE["BT"], IS_VARLEN=False, USE_LOWER_BOUND=True)
    print("kernel (KDA gate and norms)       warps")
    for w in (4, 8, 16):
        print(f"moontrain gate_norm _forward_kernel {w:4d}  "
              f"{ptxas_report(gn._forward_kernel, fwd, dict(consts, NORMS=True), w, 3)}", flush=True)
        print(f"moontrain gate_norm _backward_kernel{w:4d}  "
              f"{ptxas_report(gn._backward_kernel, bwd, dict(consts, NORMS=True), w, 3)}", flush=True)


def attn_res_rows() -> None:
    """The AttnRes aggregation's kernels (moontrain.model.attn_res_kernel) at k3_small's D = 2048 with bf16 values
    and parameters, N = 2..4 values (the backward with no gradient sum given), at their shipped tiles."""
    import triton

    from moontrain.model import attn_res_kernel as ar

    print("kernel (AttnRes, D 2048, bf16)      N warps")
    for N in (2, 3, 4):
        values = {f"v{i}": "*bf16" for i in range(N)}
        consts = {**{f"v{i}": None for i in range(N, ar.MAX_VALUES)}, "D": 2048, "N": N,
                  "N_P": triton.next_power_of_2(N), "BM": ar.BLOCK_M, "BD": ar.BLOCK_D}
        fwd = {"h_ptr": "*bf16", "r_ptr": "*fp32", "p_ptr": "*fp32", "qry_ptr": "*bf16", "kw_ptr": "*bf16",
               "eps": "fp32", **values}
        bwd = {"gh_ptr": "*bf16", "r_ptr": "*fp32", "p_ptr": "*fp32", "qry_ptr": "*bf16", "kw_ptr": "*bf16",
               "gq_ptr": "*fp32", **values, **{f"g{i}": "*bf16" for i in range(N)}}
        bwd_consts = {**consts, **{f"g{i}": None for i in range(N, ar.MAX_VALUES)}, "SUM_INTO": 0}
        print(f"moontrain attn_res _fwd_kernel      {N} {ar.FWD_WARPS:5d}  "
              f"{ptxas_report(ar._fwd_kernel, fwd, consts, ar.FWD_WARPS, 3)}", flush=True)
        print(f"moontrain attn_res _bwd_kernel      {N} {ar.BWD_WARPS:5d}  "
              f"{ptxas_report(ar._bwd_kernel, bwd, bwd_consts, ar.BWD_WARPS, 3)}", flush=True)
    params = {"parts_ptr": "*fp32", "qry_ptr": "*bf16", "kw_ptr": "*bf16", "gq_out_ptr": "*bf16",
              "gw_out_ptr": "*bf16"}
    print(f"moontrain attn_res _param_grad_kernel - {4:5d}  "
          f"{ptxas_report(ar._param_grad_kernel, params, dict(D=2048, BP=ar.PARAM_PARTS, BC=ar.PARAM_COLS), 4, 3)}",
          flush=True)


if __name__ == "__main__":
    main()
