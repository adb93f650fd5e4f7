"""One GRPO update: the train state, the pure step, its engines and the trainer shell.

``state`` holds the pure ``grpo_train_step(state, batch)``; ``engines`` the compiled forms of
it a trainer runs (one program, the optimizer split by layer, the layer-by-layer update);
``trainer`` the ``GRPOTrainer`` that holds a model and its optimizer. It may import ``core``,
the batch and packing modules, the models and the generic training modules; never
``rollouts`` or ``run``.
"""
