"""artifex GRPO: Group Relative Policy Optimization in JAX / Flax NNX."""

__version__ = "0.1.0"

__all__ = ["__version__"]
