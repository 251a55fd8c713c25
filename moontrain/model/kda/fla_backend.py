"""Which kernels run two of fla-core's KDA backward stages (kernels.kda_dqkg: the WY / inter-chunk stage, "fla"
or "moontrain": moontrain.model.kda.dqkg_kernel; kernels.kda_intra: the intra-chunk stage, "fla" or "fla_k64":
fla's kernel with 64-wide K-blocks, moontrain.model.kda.intra_fla). Process-wide, as fla's choice is: fla dispatches both stages through its
backend registry (fla.backends); the one backend registered here answers a stage's calls while that stage is
routed here, and only the calls its kernel takes (its verifier); fla's own wrappers run the others."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

DQKG = "chunk_kda_bwd_wy_dqkg_fused"
INTRA = "chunk_kda_bwd_intra"


DQKG_KERNELS = ("fla", "moontrain")
INTRA_KERNELS = ("fla", "fla_k64")


def route_fla_stages(*, dqkg: str, intra: str) -> None:
    """Run fla's dqkg stage on `dqkg` (DQKG_KERNELS) and its intra-chunk stage on `intra` (INTRA_KERNELS); "fla"
    leaves a stage to fla's own wrapper."""
    if dqkg not in DQKG_KERNELS or intra not in INTRA_KERNELS:
        raise ValueError(f"route_fla_stages: dqkg={dqkg!r} (one of {DQKG_KERNELS}), intra={intra!r} (one of "
                         f"{INTRA_KERNELS})")
    _fla_backend().routed = {DQKG: dqkg, INTRA: intra}


def runs_moontrain_dqkg(**kwargs) -> bool:
    """Would fla's dqkg stage, called with these keyword arguments, run on moontrain's kernel (routed there, and
    the kernel takes the call)? A caller that calls the kernel directly (with its own options) asks this first,
    so a call the kernel refuses still goes to fla's own, as the dispatch would send it."""
    return _fla_backend()().chunk_kda_bwd_wy_dqkg_fused_verifier(**kwargs)[0]


def routed_stages() -> dict[str, str]:
    """{fla's stage function name: the kernel that runs it}, as route_fla_stages last set it."""
    return dict(_fla_backend().routed)


@functools.cache
def _fla_backend() -> type:
    """The backend class, registered with fla once per process (routing nothing until route_fla_stages)."""
    from fla.backends import BaseBackend, register

    from moontrain.model.kda import dqkg

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
            if type(self).routed[INTRA] == "fla":
                return False, "kernels.kda_intra=fla"
            return True, None  # fla_k64: fla's own kernel, which takes every call fla's wrapper takes

        def chunk_kda_bwd_intra(self, **kwargs) -> tuple[torch.Tensor, ...]:
            from moontrain.model.kda import intra_fla

            return intra_fla.kda_intra_fla(**kwargs)

    return MoontrainStages
