"""The training loop: ``train()``, its stages, evaluation and the checks before a run.

The top layer of the package: it may import every other part (``core``, ``update``,
``rollouts``, ``rewards``) and the generic training modules (logging, checkpoints, trackers);
nothing in this package imports it.
"""
