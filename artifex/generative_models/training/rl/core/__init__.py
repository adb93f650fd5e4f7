"""The GRPO core: the batch, the configuration and pure functions of arrays.

The batch (``batch``: ``GRPOBatch``; ``packing``: ``PackedGRPOBatch``, completions packed
into rows without padding), the configuration (``configs``), advantages, the surrogate and KL
pieces, the objective, per-token log-probs, the distillation divergences and the teacher's
terms. Everything here is a pure function of its arguments (no model held, no optimizer, no
I/O). It may import the models, the generic training modules (``training.sharding``, ...) and
``utils``; never ``update``, ``rollouts``, ``run`` or ``rewards``.
"""
