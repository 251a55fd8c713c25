"""Kimi Delta Attention, K3's linear attention: the layer (layer), its recurrence in pure PyTorch (ops, the
specification) and on fla-core's kernels (ops.kda_fla), the two fla backward stages moontrain writes itself
(dqkg, intra: each a PyTorch specification beside its Triton kernel; fla_backend routes fla to them), and the
short convolutions (short_conv, the specification, and short_conv_kernel). docs/kda.md is the design record."""
