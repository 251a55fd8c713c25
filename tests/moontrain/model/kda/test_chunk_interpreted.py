"""moontrain.model.kda.chunk (fla's stages between moontrain's gate-and-norm kernels) against fla-core's own
chunk_kda, both in Triton's interpreter on the CPU (tests.moontrain.model.kda.fla_interpreted; skipped where
fla-core is not installed): the output and every input gradient, with the forward's states kept and recomputed,
on batch rows with a partial last chunk and on packed documents listed on the device (fla's use_graph), for the
bounded and the softplus gate, with the intra-chunk stage on each of its kernels (kernels.kda_intra: fla_k64, the
default, fla's, and moontrain's, which applies the norms' backward in the same kernel).

Tolerance: the two calls run the same fla kernels between ends that compute the same values in another order:
the forward's g and norms are bitwise fla's (checked here), so o is bitwise on fla's state walk and output
(walk=False); on moontrain's one-kernel walk (the default) the same products sum in another order in the
interpreter (each K-block a matmul), which moves a rare element of o by one bf16 ulp; the backward's ends sum the same
terms in another order, a few fp32 roundings (2^-24 each) of each gradient, then one bf16 rounding of q's, k's
and f's gradients that can land on the adjacent value: 2^-7 of the largest gradient (one bf16 ulp of it). On the
fused intra route the dqkg stage's part of dq and dk also passes through bf16 once (a rounding of that part, not a
derived bound on the output): measured within the same bound here, and on an H100 at 4 x 4096 x 16 the largest
difference from fla's was unchanged (docs/kda.md).
The calls are also checked against the PyTorch KDA (moontrain.model.kda.ops.kda) at bf16's tolerance.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent; then fla's shims (skips where fla-core is absent)
import tests.moonep.helpers.triton_interpreted
import tests.moontrain.model.kda.fla_interpreted  # noqa: F401
from moontrain.model.kda import chunk, intra_fla
from moontrain.model.kda.fla_backend import route_fla_stages, routed_stages
from moontrain.model.kda.ops import kda, kda_fla, random_kda_inputs
from tests.moontrain.model.kda.test_dqkg_kernel_interpreted import use_tiles

NAMES = ("o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias")


@pytest.fixture(autouse=True)
def moontrain_dqkg(monkeypatch: pytest.MonkeyPatch):
    """The model's default routing (fla's own dqkg kernel misbehaves in the interpreter on batch rows), its
    kernels on one tile each."""
    use_tiles(monkeypatch, 32, 32, 32)
    before = routed_stages()
    route_fla_stages(dqkg="moontrain", intra="fla")
    yield
    route_fla_stages(dqkg=before["chunk_kda_bwd_wy_dqkg_fused"], intra=before["chunk_kda_bwd_intra"])


def run(fn, inputs: list, kwargs: dict, go: torch.Tensor, **extra) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    A_log = kwargs["A_log_H"].clone().requires_grad_()
    dt_bias = kwargs["dt_bias_HK"].clone().requires_grad_()
    o = fn(*leaves, **{**kwargs, "A_log_H": A_log, "dt_bias_HK": dt_bias}, **extra)
    o.backward(go.to(o.dtype))
    return [o.detach()] + [t.grad for t in leaves] + [A_log.grad, dt_bias.grad]


# (T, document length, recompute, gate's lower bound, the intra-chunk stage's kernel: kernels.kda_intra, the
# forward's walk and output in one kernel)
CASES = [(160, None, False, -5.0, "fla_k64", True), (160, 48, True, -5.0, "fla_k64", True),
         (96, 40, False, None, "fla", False), (160, 48, False, -5.0, "moontrain", True)]


@pytest.mark.slow  # ~12 s a case in the interpreter; CI runs them
@pytest.mark.parametrize(("T", "doc_len", "recompute", "lower_bound", "intra", "walk"), CASES)
def test_chunk_matches_fla_chunk_kda(T: int, doc_len: int | None, recompute: bool, lower_bound: float | None,
                                     intra: str, walk: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    # both calls run fla's dispatched stage on it (the comparison still isolates the ends); moontrain's is no fla
    # stage: fla's call takes fla_k64, ours the fused kernel
    route_fla_stages(dqkg="moontrain", intra=intra if intra != "moontrain" else "fla_k64")
    if intra == "fla_k64":
        launch = intra_fla.kda_intra_fla
        monkeypatch.setattr(intra_fla, "kda_intra_fla", lambda **kw: calls.append(1) or launch(**kw))
    if intra == "moontrain":
        launch = chunk.kda_intra_norm
        monkeypatch.setattr(chunk, "kda_intra_norm", lambda *a, **kw: calls.append(a[6].dtype) or launch(*a, **kw))
    inputs, kwargs, go = random_kda_inputs(2, T, 2, 64, doc_len=doc_len, seed=T, device="cpu")
    kwargs["lower_bound"] = lower_bound
    ours = run(kda_fla, inputs, kwargs, go, recompute=recompute, gate_norm=True, intra_norm=intra == "moontrain",
               walk=walk)
    fla = run(kda_fla, inputs, kwargs, go, recompute=recompute, gate_norm=False)
    spec = run(kda, inputs, kwargs, go)
    assert len(calls) == {"fla": 0, "fla_k64": 2, "moontrain": 1}[intra], f"kda_intra={intra}: {len(calls)} launches"
    if intra == "moontrain":  # moontrain's dqkg stage hands the fused stage dq and dk in q's dtype
        assert calls == [inputs[0].dtype], calls
    if not walk:
        assert torch.equal(ours[0], fla[0]), "o: not bitwise fla's"
    top = fla[0].float().abs().max().item()
    assert (ours[0].float() - fla[0].float()).abs().max().item() <= 2 ** -7 * top, "o: over one bf16 ulp from fla's"
    for name, x, y, z in zip(NAMES, ours, fla, spec, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype}"
        assert torch.isfinite(x).all(), f"{name}: not finite"
        top = y.float().abs().max().item()
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 2 ** -7 * top, f"{name}: max |diff| from fla {err:.2e} > 2^-7 x {top:.2e}"
        err_spec = (x.float() - z.float()).abs().max().item()
        err_fla_spec = (y.float() - z.float()).abs().max().item()
        assert err_spec <= 1.25 * err_fla_spec + 2 ** -7 * top, (
            f"{name}: {err_spec:.2e} from the PyTorch KDA, fla {err_fla_spec:.2e}")


@pytest.mark.slow
def test_chunk_through_a_stack_with_flas_static_buffers() -> None:
    """Two stacked KDA calls with residuals on documents, fla's own dqkg stage (which in its use_graph mode
    returns dv and db in buffers it reuses for the next call's backward): moontrain's call with device-listed
    chunks (use_graph) against fla's chunk_kda with host-listed ones (no reused buffers), output and every input
    and parameter gradient, as test_chunk_matches_fla_chunk_kda bounds them. A gradient handed on in a reused
    buffer and read after the next backward would be off by its size."""
    route_fla_stages(dqkg="fla", intra="fla")
    inputs, kwargs, go = random_kda_inputs(2, 96, 2, 64, doc_len=40, seed=7, device="cpu")
    x0, _, _, f0, beta0 = inputs
    layers = [(f0.detach() * s, beta0.detach() * s) for s in (1.0, 0.5)]

    def stack(gate_norm: bool, device_chunks: bool) -> list[torch.Tensor]:
        x = x0.detach().clone().requires_grad_()
        params = [[t.clone().requires_grad_() for t in layer] for layer in layers]
        h = x
        for f, beta in params:
            h = h + kda_fla(h, h * 0.5, h.flip(-1), f, beta, **kwargs, recompute=False, gate_norm=gate_norm,
                            device_chunks=device_chunks)
        leaves = [x, *(t for p in params for t in p)]
        return [h.detach(), *torch.autograd.grad(h, leaves, go)]

    ours, fla = stack(True, device_chunks=True), stack(False, device_chunks=False)
    for i, (x, y) in enumerate(zip(ours, fla, strict=True)):
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 2 ** -7 * y.float().abs().max().item(), f"output / gradient {i}: max |diff| {err:.2e}"
