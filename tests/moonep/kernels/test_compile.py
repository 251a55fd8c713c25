"""Triton kernels compiled for sm90 on the CPU (no GPU: Triton's frontend, LLVM and the bundled ptxas).

Triton's interpreter runs the kernels' Python on numpy and misses what only the compiler checks, e.g.
a name given two types in one kernel (the stale-group loop of `_accumulate_kernel` once reused `grp`,
which the loop after it reassigns as int64: fine in the interpreter, a CompilationError on the H200,
2026-11-30). Each kernel is compiled in a subprocess without TRITON_INTERPRET (the interpreted test
modules set it for their whole process). Skipped where triton or its CUDA backend is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

# (module, kernel, signature, constexprs); pointer dtypes as the launches pass them
CASES = [
    ("moonep.kernels.experts", "_accumulate_kernel",
     {"g_ptr": "*fp32", "w_ptr": "*bf16", "offs_ptr": "*i32", "scale": "fp32", "write_n": "i32",
      "G": "constexpr", "G_P": "constexpr", "ROW": "constexpr", "BLOCK": "constexpr"},
     {"G": 192, "G_P": 256, "ROW": 2097152, "BLOCK": 4096}),
    ("moonep.kernels.situ_glu", "_situ_glu_fwd_kernel",
     {"h_ptr": "*bf16", "u_ptr": "*bf16", "a_ptr": "*bf16", "n": "i64", "BLOCK": "constexpr"}, {"BLOCK": 2048}),
    ("moonep.kernels.situ_glu", "_situ_glu_bwd_kernel",
     {"ga_ptr": "*bf16", "h_ptr": "*bf16", "u_ptr": "*bf16", "gh_ptr": "*bf16", "gu_ptr": "*bf16",
      "a_ptr": "*bf16", "n": "i64", "BLOCK": "constexpr"}, {"BLOCK": 2048}),
] + [
    ("moonep.kernels.glu_route", "_glu_route_bwd_kernel",
     {"g_ptr": "*bf16", "h_ptr": "*bf16", "u_ptr": "*bf16", "w_ptr": "*fp32", "gh_ptr": "*bf16", "gu_ptr": "*bf16",
      "aw_ptr": "*bf16", "gw_ptr": "*fp32", "n_rows": "i32", "F": "i32", "stride_hu": "i32", "stride_ghu": "i32",
      "ACT": "constexpr", "BLOCK_R": "constexpr", "BLOCK_F": "constexpr"}, {"ACT": act, "BLOCK_R": 4, "BLOCK_F": 512})
    for act in (0, 1)
] + [
    ("moonep.kernels.glu_rows", "_glu_rows_fwd_kernel",
     {"hu_ptr": "*bf16", "a_ptr": "*bf16", "n_rows": "i32", "F": "i32", "ACT": "constexpr", "BLOCK_R": "constexpr",
      "BLOCK_F": "constexpr"}, {"ACT": act, "BLOCK_R": 2, "BLOCK_F": 1024})
    for act in (0, 1)
] + [
    ("moonep.planner.fused_kernels", "_chunk_match_kernel",  # K3: E = 896, ids and the padding id in 10 bits
     {"topk_ptr": "*i32", "rank_ptr": "*i32", "chunk_hist_ptr": "*i32", "plane_ptr": "*i32", "num_entries": "i32",
      "E": "i32", "CHUNK": "constexpr", "BITS": "constexpr", "BITS_P": "constexpr", "E_P": "constexpr",
      "HW_POPC": "constexpr"},
     {"CHUNK": chunk, "BITS": 10, "BITS_P": 16, "E_P": 1024, "HW_POPC": True})
    for chunk in (256, 512)
] + [
    ("moonep.planner.fused_kernels", "_prefix_kernel",
     {"chunk_hist_ptr": "*i32", "hist_ptr": "*i32", "num_chunks": "i32", "rank": "i32", "hist_rank_stride": "i64",
      "hist_row_stride": "i32", "E": "i32", "R": "constexpr", "BLOCK_C": "constexpr", "BLOCK_E": "constexpr"},
     {"R": R, "BLOCK_C": block_c, "BLOCK_E": block_e})
    for R, block_c, block_e in ((2, 64, 16), (8, 1024, 2))
] + [
    ("moonep.planner.fused_kernels", "_shared_kernel",  # K3: E = 896, R = 8
     {"hist_ptr": "*i32", "counts_ptr": "*i32", "cap_ptr": "*i64", "quota_ptr": "*i64", "alloc_ptr": "*i32",
      "slot_ptr": "*i32", "rows_ptr": "*i32", "offs_ptr": "*i32", "end_ptr": "*i32", "rowbase_ptr": "*i32",
      "rank": "i32", "cap_base": "i32", "cap_rem": "i32", "R": "constexpr", "EPN": "constexpr", "B": "constexpr",
      "PAD": "constexpr", "R_P": "constexpr", "EPN_P": "constexpr", "G_P": "constexpr", "B_P": "constexpr",
      "LOG_R_P": "constexpr", "LOG_EPN_P": "constexpr", "KEY64": "constexpr"},
     {"R": 8, "EPN": 112, "B": 112, "PAD": 16, "R_P": 8, "EPN_P": 128, "G_P": 1024, "B_P": 128, "LOG_R_P": 3,
      "LOG_EPN_P": 7, "KEY64": key64})
    for key64 in (False, True)
] + [
    ("moonep.planner.fused_kernels", "_dest_kernel",
     {"topk_ptr": "*i32", "rank_ptr": "*i32", "prefix_ptr": "*i32", "end_ptr": "*i32", "rowbase_ptr": "*i32",
      "dst_rank_ptr": "*i32", "dst_row_ptr": "*i32", "copy_row_ptr": "*i32", "sent_ptr": "*u8", "num_tokens": "i32",
      "E": "i32", "K": "i32", "R": "constexpr", "R_P": "constexpr", "K_P": "constexpr", "BLOCK_T": "constexpr",
      "CHUNK": "constexpr"},
     {"R": 8, "R_P": 8, "K_P": 16, "BLOCK_T": 32, "CHUNK": 512}),
] + [
    ("moonep.kernels.dispatch_combine", "_scatter_kernel",
     {"x_ptr": "*bf16", "w_ptr": "*fp32", "dst_rank_ptr": "*i32", "dst_row_ptr": "*i32", "copy_row_ptr": "*i32",
      "sent_ptr": "*u8", "recv_ptr": "*bf16", "row_weight_ptr": "*fp32", "row_link_ptr": "*i32",
      "row_link64_ptr": "*i64", "row_chain_ptr": "*i32", "s": "i32", "H": "i32", "x_stride": "i32",
      "recv_rank_stride": "i64", "recv_row_stride": "i32", "meta_rank_stride": "i64", "link_rank_stride": "i64",
      "src_base": "i32", "rank": "i32", "work_ptr": "*i32", "num_programs": "i32", "K": "constexpr",
      "BLOCK_K": "constexpr", "BLOCK_T": "constexpr", "BLOCK_H": "constexpr", "HAS_W": "constexpr",
      "ROWS": "constexpr", "CHAIN": "constexpr", "FENCE": "constexpr"},
     {"K": 8, "BLOCK_K": 8, "BLOCK_T": 2, "BLOCK_H": 8192, "HAS_W": True, "ROWS": rows, "CHAIN": chain,
      "FENCE": True})
    for rows, chain in ((True, False), (True, True), (False, True))
] + [
    ("moonep.kernels.dispatch_combine", "_expand_kernel",  # the launcher's tile: 64 rows x 256
     {"recv_ptr": "*bf16", "row_weight_ptr": "*fp32", "row_link_ptr": "*i32", "offs_ptr": "*i32",
      "sizes_ptr": "*i32", "nvs_s": "i32", "H": "i32", "recv_row_stride": "i32", "G": "i32", "zero_row": "i32",
      "pad": "i32", "src_base": "i32", "SK": "i32", "LOG_G": "constexpr", "BLOCK_R": "constexpr",
      "BLOCK_H": "constexpr", "COPY": "constexpr"},
     {"LOG_G": 8, "BLOCK_R": 64, "BLOCK_H": 256, "COPY": copy})
    for copy in (True, False)
] + [
    # combine's push: combine_reduce "source" as the MoE layer issues it (plain rows, row scalars)
    ("moonep.kernels.dispatch_combine", "_push_kernel",
     {"y_ptr": "*bf16", "add_ptr": "*bf16", "w_ptr": "*fp32", "scal_ptr": "*fp32", "row_link_ptr": "*i32",
      "land_ptr": "*bf16", "land_scal_ptr": "*fp32", "nvs_s": "i32", "H": "i32", "y_stride": "i32",
      "add_stride": "i32", "land_rank_stride": "i64", "land_row_stride": "i32", "land_scal_rank_stride": "i64",
      "SK": "i32", "num_iters": "i32", "num_programs": "i32", "BLOCK_R": "constexpr", "BLOCK_H": "constexpr",
      "HAS_SCAL": "constexpr", "HAS_ADD": "constexpr", "HAS_W": "constexpr", "FENCE": "constexpr"},
     {"BLOCK_R": 8, "BLOCK_H": 2048, "HAS_SCAL": scal, "HAS_ADD": False, "HAS_W": False, "FENCE": True})
    for scal in (False, True)
] + [
    # combine_reduce "destination": the chain lists (K = 1, 8, 16) and the reduce push, forward (route
    # weights folded in) and backward (the two dgrad halves added, route-weight grads as row scalars)
    ("moonep.kernels.dispatch_combine", "_chain_list_kernel",
     {"row_link_ptr": "*i32", "row_chain_ptr": "*i32", "list_ptr": "*i32", "count_ptr": "*i32", "nvs_s": "i32",
      "K": "constexpr", "BLOCK_K": "constexpr", "SEG": "constexpr"},
     {"K": k, "BLOCK_K": k, "SEG": 1024})
    for k in (1, 8, 16)
] + [
    ("moonep.kernels.dispatch_combine", "_push_reduce_kernel",
     {"y_ptr": "*bf16", "add_ptr": "*bf16", "w_ptr": "*fp32", "scal_ptr": "*fp32", "row_link_ptr": "*i32",
      "list_ptr": "*i32", "count_ptr": "*i32", "land_ptr": "*bf16", "land_scal_ptr": "*fp32", "num_segs": "i32",
      "H": "i32", "y_stride": "i32", "add_stride": "i32", "land_rank_stride": "i64", "land_row_stride": "i32",
      "land_scal_rank_stride": "i64", "SK": "i32", "num_programs": "i32", "K": "constexpr", "SEG": "constexpr",
      "MAX_SEGS": "constexpr", "BLOCK_P": "constexpr", "BLOCK_H": "constexpr", "HAS_SCAL": "constexpr",
      "HAS_ADD": "constexpr", "HAS_W": "constexpr", "FENCE": "constexpr"},
     {"K": 8, "SEG": 1024, "MAX_SEGS": 256, "BLOCK_P": 4, "BLOCK_H": 512, "HAS_SCAL": scal, "HAS_ADD": add,
      "HAS_W": w, "FENCE": True})
    for scal, add, w in ((False, False, True), (True, True, False), (False, False, False))
] + [
    ("moonep.kernels.dispatch_combine", "_reduce_kernel",
     {"land_ptr": "*bf16", "sent_ptr": "*u8", "out_ptr": "*bf16", "s": "i32", "H": "i32", "land_row_stride": "i32",
      "out_stride": "i32", "K": "constexpr", "BLOCK_T": "constexpr", "BLOCK_H": "constexpr",
      "FIRST_ONLY": "constexpr"},
     {"K": 8, "BLOCK_T": 4, "BLOCK_H": 1024, "FIRST_ONLY": first})
    for first in (False, True)
] + [
    ("moontrain.optim.write_back_kernel", "_adamw_write_back_kernel",  # OUT_KIND 0/1/2: fp32/bf16/fp16 copies
     {"ptrs_ptr": "*i64", "numel_ptr": "*i64", "first_ptr": "*i64", "owner_ptr": "*i32", "bc_ptr": "*fp32",
      "scale_ptr": "*fp32", "skip_ptr": "*fp32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32",
      "weight_decay": "fp32", "HAS_SCALE": "constexpr", "HAS_SKIP": "constexpr", "ZERO": "constexpr",
      "OUT_KIND": "constexpr", "BLOCK": "constexpr"},
     {"HAS_SCALE": scale, "HAS_SKIP": skip, "ZERO": zero, "OUT_KIND": kind, "BLOCK": 2048})
    for scale, skip, zero, kind in ((False, False, False, 1), (True, True, False, 1), (True, True, True, 0),
                                    (False, True, True, 2))
] + [
    ("moontrain.model.attn_res_kernel", "_fwd_kernel",  # K3: N <= 4 values of D = 2048
     {"h_ptr": "*bf16", "r_ptr": "*fp32", "p_ptr": "*fp32", "qry_ptr": "*bf16", "kw_ptr": "*bf16", "M": "i32",
      "eps": "fp32",
      **{f"v{i}": "*bf16" if i < 4 else "constexpr" for i in range(16)},
      "D": "constexpr", "N": "constexpr", "N_P": "constexpr", "BM": "constexpr", "BD": "constexpr"},
     {**{f"v{i}": None for i in range(4, 16)}, "D": 2048, "N": 4, "N_P": 4, "BM": 4, "BD": 1024}),
    ("moontrain.model.attn_res_kernel", "_bwd_kernel",
     {"gh_ptr": "*bf16", "r_ptr": "*fp32", "p_ptr": "*fp32", "qry_ptr": "*bf16", "kw_ptr": "*bf16", "gq_ptr": "*fp32",
      "M": "i32",
      **{f"{c}{i}": "*bf16" if i < 3 else "constexpr" for c in "vg" for i in range(16)},
      "D": "constexpr", "N": "constexpr", "N_P": "constexpr", "BM": "constexpr", "BD": "constexpr",
      "SUM_INTO": "constexpr"},  # two completed blocks' gradient sums, the partial sum's fresh gradient
     {**{f"{c}{i}": None for c in "vg" for i in range(3, 16)}, "D": 2048, "N": 3, "N_P": 4, "BM": 4, "BD": 1024,
      "SUM_INTO": 3}),
    ("moontrain.model.attn_res_kernel", "_param_grad_kernel",  # the 512 programs' dq partials, bf16 parameters
     {"parts_ptr": "*fp32", "qry_ptr": "*bf16", "kw_ptr": "*bf16", "gq_out_ptr": "*bf16", "gw_out_ptr": "*bf16",
      "P": "i32", "D": "constexpr", "BP": "constexpr", "BC": "constexpr"},
     {"D": 2048, "BP": 64, "BC": 64}),
    ("moontrain.model.lm_loss_kernel", "_row_stats_kernel",  # k3_small's vocab: 163,840 = 10 splits of 16,384
     {"x_ptr": "*bf16", "max_ptr": "*fp32", "sum_ptr": "*fp32", "V": "i32", "S": "i32", "SPLIT": "constexpr",
      "BV": "constexpr"},
     {"SPLIT": 16384, "BV": 2048}),
    ("moontrain.model.lm_loss_kernel", "_combine_kernel",
     {"x_ptr": "*bf16", "t_ptr": "*i64", "max_ptr": "*fp32", "sum_ptr": "*fp32", "lse_ptr": "*fp32",
      "loss_ptr": "*fp32", "V": "i32", "S": "i32", "S_P": "constexpr"},
     {"S_P": 16}),
    ("moontrain.model.lm_loss_kernel", "_grad_kernel",
     {"x_ptr": "*bf16", "lse_ptr": "*fp32", "t_ptr": "*i64", "V": "i32", "inv_n": "fp32", "BV": "constexpr"},
     {"BV": 2048}),
    ("moontrain.parallel.grad_accumulate_kernel", "_accumulate_kernel",  # a dtype constexpr: "tl.<name>"
     {"chunks_ptr": "*i64", "addrs_ptr": "*i64", "numels_ptr": "*i64", "GRAD": "constexpr", "BLOCK": "constexpr"},
     {"GRAD": "tl.bfloat16", "BLOCK": 4096}),
]

_SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, kernel, signature, constexprs = json.loads(sys.argv[1])
constexprs = {k: getattr(triton.language, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
              for k, v in constexprs.items()}
fn = getattr(importlib.import_module(module), kernel)
src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
"""


def _backend_available() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _backend_available(), reason="triton without its CUDA backend")
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_kernel_compiles_for_sm90(case: tuple) -> None:
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(case)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{case[0]}.{case[1]} does not compile for sm90:\n{proc.stderr[-3000:]}"
