"""Flow-GRPO in the main training loop: rollout, evaluation, rewards and images of flow models.

A flow-matching image model trains with the same loop as a language model
(:func:`~artifex.generative_models.training.rl.train`): :class:`FlowRollout` samples SDE
trajectories and packs them into the flow ``GRPOBatch``, :class:`FlowEvaluator` scores ODE
samples of held-out prompts and writes image grids, :func:`image_reward` puts image rewards
into the loop's reward protocol, and :func:`train_flow` wires them together.
"""

from artifex.generative_models.flow.images import (
    as_images,
    describe_shapes,
    image_grid,
    write_png,
)
from artifex.generative_models.flow.rewards import compositional, image_reward
from artifex.generative_models.flow.rollout import (
    FlowEvaluator,
    FlowRollout,
    FlowRolloutResult,
    encode_flow_prompts,
)
from artifex.generative_models.flow.train import flow_trainer, train_flow

__all__ = [
    "FlowEvaluator",
    "FlowRollout",
    "FlowRolloutResult",
    "as_images",
    "compositional",
    "describe_shapes",
    "encode_flow_prompts",
    "flow_trainer",
    "image_grid",
    "image_reward",
    "train_flow",
    "write_png",
]
