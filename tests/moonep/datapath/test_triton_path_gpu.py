"""The refactored data paths on one GPU (R = 1, a one-rank NCCL group of this process): the Triton
path (kernels, fused planner, expert kernels, fused activations) against the PyTorch path, bitwise
for data movement, and a whole MoE layer per activation (torch path, triton path, triton path with
BufferOptions.fused_expert_gemm or with expert_gemm="quack") against the dense reference with the derived tolerance of
tests/moonep/test_moe_layer.py. At R = 1 no expert is remote (no slot is used);
the two-GPU tests (tests/moonep/**/*_multigpu.py, torchrun) cover the peers.

    python -m pytest -q -m gpu tests/moonep/datapath/test_triton_path_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, expert_glu, glu_projections
from tests.moonep import test_moe_layer as cpu_moe
from tests.moonep.helpers.moe_reference import reference_grads
from tests.moonep.kernels import test_dispatch_combine_multigpu as two_gpu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("maxvio,s,hidden", [(0.0, two_gpu.S, two_gpu.H), (2.9, two_gpu.S, two_gpu.H),
                                             (2.0, two_gpu.S - 37, 1000)])
def test_triton_path_bitwise_equals_torch_path_one_gpu(one_rank: dist.ProcessGroup, maxvio: float, s: int,
                                                       hidden: int) -> None:
    ref, fast = two_gpu._buffers(one_rank, hidden)
    try:
        assert (ref.kernel_path, fast.kernel_path) == ("torch", "triton")
        inp = two_gpu._inputs(ref, 0, s, hidden, maxvio)
        want = two_gpu._sequence(ref, inp)
        got = two_gpu._sequence(fast, inp)
        torch.cuda.synchronize()
        for name in want:
            two_gpu._bitwise(got[name], want[name], f"maxvio {maxvio} s {s} H {hidden}: {name}")
    finally:
        fast.destroy()
        ref.destroy()


Hs, Fs, Ks, Ss, Es = 512, 2048, 4, 64, 16  # 512*2048*2 B = 2 MiB per expert row (one VMM granule)


@functools.lru_cache(maxsize=1)  # the tests run activation by activation
def _dense_reference(activation: str) -> tuple:
    """The problem and its bf16 and fp64 dense references on the CPU (~8 s on a GPU host's cores), once per
    activation: the five kernel variants of the test below share them."""
    x, w, topk, weights, grad_y = cpu_moe._problem(1, Es, 2.5, H=Hs, F=Fs, K=Ks, S=Ss)
    args = (x[0], weights[0], topk[0], w, grad_y[0])
    return (x, w, topk, weights, grad_y, reference_grads(*args, torch.bfloat16, activation),
            reference_grads(*args, torch.float64, activation))


# fused: BufferOptions.fused_expert_gemm; quack / quack_wgrad: BufferOptions.expert_gemm (skipped where quack does
# not import); dest: BufferOptions.combine_reduce="destination"
@pytest.mark.parametrize("kernels", ["torch", "triton", "triton+fused", "triton+quack", "triton+quack_wgrad",
                                     "torch+dest", "triton+dest", "triton+quack+dest"])
@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_moe_layer_one_gpu_matches_dense_reference(one_rank: dist.ProcessGroup, kernels: str, activation: str) -> None:
    x, w, topk, weights, grad_y, ref16, ref64 = _dense_reference(activation)
    path, *variants = kernels.split("+")
    quack = next((v for v in variants if v.startswith("quack")), None)
    if quack:
        from moonep.kernels import quack_gemm

        if reason := quack_gemm.unavailable(torch.cuda.current_device()):
            pytest.skip(reason)
    options = BufferOptions(kernels=path, fused_expert_gemm="fused" in variants,
                            expert_gemm=quack or "torch",
                            combine_reduce="destination" if "dest" in variants else "source")
    buf = Buffer(BufferConfig(max_tokens=Ss, hidden=Hs, topk=Ks, num_experts=Es, options=options), one_rank)
    try:
        pools = ExpertPools(buf, glu_projections(Hs, Fs))
        layer = pools.add_layer()
        for p in w:
            layer.w_local[p].copy_(w[p].cuda())
        x_sH = x[0].cuda().requires_grad_()
        w_sK = weights[0].cuda().requires_grad_()
        y = expert_glu(buf, pools, layer, x_sH, w_sK, topk[0].cuda(), activation=activation)
        (y.double() * grad_y[0].cuda().double()).sum().backward()
        buf.wait_pending()
        got = {"y": y.detach().cpu(), "gx": x_sH.grad.cpu(), "gw": w_sK.grad.cpu(),
               **{p: layer.g_local[p].cpu() for p in w}}
        y16, gx16, gw16, gW16 = ref16
        y64, gx64, gw64, gW64 = ref64
        cpu_moe._close("y", got["y"], y16, y64)
        cpu_moe._close("grad x", got["gx"], gx16, gx64)
        cpu_moe._close("grad route weights", got["gw"], gw16, gw64)
        for p in w:
            cpu_moe._close(f"grad W_{p}", got[p], gW16[p], gW64[p])
    finally:
        buf.destroy()
