"""From dataset rows to scored batches: sampling, rewards, multi-turn episodes and tools.

A rollout sees the policy as a :class:`~artifex.generative_models.training.rl.core.policy.Policy`
(model, config, mesh) and returns a ``GRPOBatch``; it never calls into the trainer. It
may import ``core``, ``rewards``, the batch module, the sampler (``inference``), the models and the
generic training modules; never ``update`` or ``run``.
"""
