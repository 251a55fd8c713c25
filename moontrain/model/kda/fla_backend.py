"""Which of fla-core's KDA backward stages run on moontrain's kernels (kernels.kda_dqkg: the WY / inter-chunk
stage on moontrain.model.kda.dqkg_kernel; kernels.kda_intra: the intra-chunk stage on
moontrain.model.kda.intra_kernel). Process-wide, as fla's choice is: fla dispatches both stages through its
backend registry (fla.backends); the one backend registered here answers a stage's calls while that stage is
routed here, and only the calls its kernel takes (its verifier); fla's kernels run the others."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

DQKG = "chunk_kda_bwd_wy_dqkg_fused"
INTRA = "chunk_kda_bwd_intra"


def route_fla_stages(*, dqkg: bool, intra: bool) -> None:
    """Route fla's dqkg stage (dqkg) and intra-chunk stage (intra) to moontrain's kernels, or back to fla's."""
    _fla_backend().routed = {DQKG: dqkg, INTRA: intra}


def routed_stages() -> dict[str, bool]:
    """{fla's stage function name: routed to moontrain}, as route_fla_stages last set it."""
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
        routed: ClassVar[dict[str, bool]] = {DQKG: False, INTRA: False}

        def is_enabled(self) -> bool:
            return any(type(self).routed.values())

        def chunk_kda_bwd_wy_dqkg_fused_verifier(self, **kwargs) -> tuple[bool, str | None]:
            if not type(self).routed[DQKG]:
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
            if not type(self).routed[INTRA]:
                return False, "kernels.kda_intra=fla"
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
            from moontrain.model.kda import intra_kernel

            return intra_kernel.kda_intra(**kwargs)

    return MoontrainStages
