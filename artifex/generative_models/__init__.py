"""Generative models: causal language models, inference and training."""
