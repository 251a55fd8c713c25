"""Known-harmless warnings a training job would print on every run, filtered by their exact text (anything
else still prints). Each is listed with why it is harmless here.

- FSDP2 "FSDP2-wrapped module (FSDPBlock) returned a view tensor ... can cause backward to fail or
  produce wrong gradients" (torch >= 2.11): with Block Attention Residuals a block returns the completed
  blocks it received (model.attn_res) unchanged, and FSDP2 hands a block its inputs as views (its
  post-backward hook is an autograd Function that returns them), so those outputs are views. The
  hazard is an in-place op on such an output dropping FSDP's pre-backward hook; nothing writes to the
  completed blocks in place (DepthAttention only reads them), and tests/moontrain/parallel compare the
  FSDP gradients with the unsharded ones.
- Inductor "Online softmax is disabled on the fly since Inductor decides to split the reduction"
  (train.compile on the GPU): a performance note on how a softmax reduction is lowered (two passes
  instead of the fused online form); the values are the same softmax.
"""

from __future__ import annotations

import warnings

KNOWN_HARMLESS = (
    (r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor", UserWarning),
    (r"\s*Online softmax is disabled on the fly", UserWarning),
)


def silence_known_warnings() -> None:
    for message, category in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
