"""Single-process dense reference of an MoE layer: every token looped over its K experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moonep import merge_gate_up, split_gate_up


def glu(activation: str, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The gated activations by their textbook formulas (autograd gives their gradients)."""
    if activation == "situ_glu":
        return 4 * torch.tanh(h / 4) * torch.sigmoid(h) * (25 * torch.tanh(u / 25))
    return F.silu(h) * u


def merged(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert weights drawn as gate, up, down -> the projections moonep holds (gate_up, down)."""
    return {"gate_up": merge_gate_up(w["gate"], w["up"]), "down": w["down"]}


def dense_moe(x_NH: torch.Tensor, weights_NK: torch.Tensor, topk_NK: torch.Tensor,
              w: dict[str, torch.Tensor], activation: str = "swiglu") -> torch.Tensor:
    """y[t] = sum_k weights[t,k] * f(x W_gate[e], x W_up[e]) W_down[e] in x's dtype (f: silu(h) * u or
    SiTU-GLU; W_gate, W_up the halves of w["gate_up"]), the sum over k in fp32 (as moonep's combine)."""
    w_gate, w_up = split_gate_up(w["gate_up"])
    y = torch.zeros(x_NH.shape, dtype=torch.float32 if x_NH.dtype != torch.float64 else torch.float64)
    for k in range(topk_NK.shape[1]):
        e = topk_NK[:, k].long()
        h = torch.bmm(x_NH[:, None, :], w_gate[e])[:, 0]
        u = torch.bmm(x_NH[:, None, :], w_up[e])[:, 0]
        o = torch.bmm(glu(activation, h, u)[:, None, :], w["down"][e])[:, 0]
        y = y + (o.to(y.dtype) * weights_NK[:, k, None].to(y.dtype)).to(x_NH.dtype).to(y.dtype)
    return y.to(x_NH.dtype)


def reference_grads(x_NH, weights_NK, topk_NK, w, grad_y_NH, dtype, activation: str = "swiglu"):
    """Output and grads (x, route weights, every expert weight) of dense_moe at `dtype`."""
    x = x_NH.to(dtype).clone().requires_grad_()
    wt = weights_NK.to(torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_()
    ws = {k: v.to(dtype).clone().requires_grad_() for k, v in w.items()}
    y = dense_moe(x, wt, topk_NK, ws, activation)
    (y.to(torch.float64) * grad_y_NH.to(torch.float64)).sum().backward()
    return y.detach(), x.grad, wt.grad, {k: v.grad for k, v in ws.items()}
