"""Inference: compiled sampling from causal language models."""
