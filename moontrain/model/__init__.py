"""The K3-like decoder: MLA attention, dense gated-FFN first layer(s), latent MoE layers, LM head."""
