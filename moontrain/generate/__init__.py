"""Inference from a checkpoint or an HF directory: loading a model on one device, a decoding cache
(MLA's compressed latents per attention layer), sampling, and held-out evaluation."""
