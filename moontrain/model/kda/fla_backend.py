"""Which kernels run two of fla-core's KDA backward stages (kernels.kda_dqkg: the WY / inter-chunk stage, "fla"
or "moontrain": moontrain.model.kda.dqkg_kernel; kernels.kda_intra: the intra-chunk stage, "fla", "fla_k64":
fla's kernel with 64-wide K-blocks, moontrain.model.kda.intra_fla, or "moontrain":
moontrain.model.kda.intra_kernel). Process-wide, as fla's choice is: fla dispatches both stages through its
backend registry (fla.backends); the one backend registered here answers a stage's calls while that stage is
routed here, and only the calls its kernel takes (its verifier); fla's own wrappers run the others."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

DQKG = "chunk_kda_bwd_wy_dqkg_fused"
INTRA = "chunk_kda_bwd_intra"


DQKG_KERNELS = ("fla", "moontrain")
INTRA_KERNELS = ("fla", "fla_k64", "moontrain")


def route_fla_stages(*, dqkg: str, intra: str) -> None:
    """Run fla's dqkg stage on `dqkg` (DQKG_KERNELS) and its intra-chunk stage on `intra` (INTRA_KERNELS); "fla"
    leaves a stage to fla's own wrapper."""
    if dqkg not in DQKG_KERNELS or intra not in INTRA_KERNELS:
        raise ValueError(f"route_fla_stages: dqkg={dqkg!r} (one of {DQKG_KERNELS}), intra={intra!r} (one of "
                         f"{INTRA_KERNELS})")
    _fla_backend().routed = {DQKG: dqkg, INTRA: intra}


def routed_stages() -> dict[str, str]:
    """{fla's stage function name: the kernel that runs it}, as route_fla_stages last set it."""
    return dict(_fla_backend().routed)


@functools.cache
def _fla_backend() -> type:
    """The backend class, registered with fla once per process (routing nothing until route_fla_stages)."""
    from fla.backends import BaseBackend, register

    from moontrain.model.kda import dqkg, intra

    @register("kda")
    class MoontrainStages(BaseBackend):
        backend_type = "moontrain_kda"
        priority = 0  # before fla's own backends (theirs: 3 and up)
        routed: ClassVar[dict[str, str]] = {DQKG: "fla", INTRA: "fla"}

        def is_enabled(self) -> bool:
            return any(kernel != "fla" for kernel in type(self).routed.values())

        def chunk_kda_bwd_wy_dqkg_fused_verifier(self, **kwargs) -> tuple[bool, str | None]:
            if type(self).routed[DQKG] == "fla":
                return False, "kernels.kda_dqkg=fla"
            try:
                dqkg.validate(kwargs["q"], kwargs["k"], kwargs["v"], kwargs["g"], kwargs["beta"], kwargs["A"],
                                  kwargs["h"], kwargs.get("state_v_first", False), kwargs.get("cu_seqlens"),
                                  kwargs.get("chunk_size", dqkg.CHUNK), kwargs.get("chunk_indices"))
            except ValueError as err:
                return False, str(err)
            return True, None

        def chunk_kda_bwd_wy_dqkg_fused(self, **kwargs) -> tuple[torch.Tensor, ...]:
            from moontrain.model.kda import dqkg_kernel

            return dqkg_kernel.kda_dqkg(**kwargs)

        def chunk_kda_bwd_intra_verifier(self, **kwargs) -> tuple[bool, str | None]:
            kernel = type(self).routed[INTRA]
            if kernel == "fla":
                return False, "kernels.kda_intra=fla"
            if kernel == "fla_k64":  # fla's own kernel: it takes every call fla's wrapper takes
                return True, None
            if not kwargs.get("safe_gate", False):
                return False, "safe_gate=False: an unbounded gate runs on fla's kernel"
            names = ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg")
            try:
                intra.validate(*(kwargs[n] for n in names), kwargs.get("cu_seqlens"),
                                   kwargs.get("chunk_size", intra.CHUNK))
            except ValueError as err:
                return False, str(err)
            if any(kwargs[n].dtype != torch.float32 for n in ("dq", "dk", "db", "dg")):
                return False, "dq, dk, db and dg are not all fp32"
            return True, None

        def chunk_kda_bwd_intra(self, **kwargs) -> tuple[torch.Tensor, ...]:
            if type(self).routed[INTRA] == "fla_k64":
                from moontrain.model.kda import intra_fla

                return intra_fla.kda_intra_fla(**kwargs)
            from moontrain.model.kda import intra_kernel

            return intra_kernel.kda_intra(**kwargs)

    return MoontrainStages
