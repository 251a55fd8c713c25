"""The K3-like decoder: MLA attention, dense SwiGLU first layer(s), latent MoE layers, LM head."""
