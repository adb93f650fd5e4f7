"""The GRPO core: the batch, the configuration and pure functions of arrays.

Advantages, the surrogate and KL pieces, the objective, per-token log-probs, the
distillation divergences and the teacher's terms. Everything here is a pure function of its
arguments (no model held, no optimizer, no I/O). It may import the models, the generic
training modules (``training.sharding``, ...), ``utils`` and the batch and packing modules of
this package; never ``update``, ``rollouts``, ``run`` or ``rewards``.
"""
