"""One training run reporting to experiment trackers (for training/test_trackers.py).

Run as ``python -m tests.generative_models.training.tracker_worker OUT NAMES`` (``NAMES`` as
``--report-to`` takes them, e.g. ``tensorboard,wandb,trackio``) with ``WANDB_MODE=offline`` and
``TRACKIO_DIR`` set by the test: trackio reads its directory once, when it is imported, so the run
gets a process of its own. The tiny demo model trains 2 steps (completions logged every step,
held-out evaluation before, after step 1 and at the end) with ``log_dir=OUT/logs``; what trackio
stored is read back with trackio's own storage API into ``OUT/trackio.json``.
"""

from __future__ import annotations

import json
import os
import sys


def main(out: str, names: str) -> None:
    import optax
    from flax import nnx

    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from artifex.generative_models.training.rl.rollout import RolloutConfig
    from tests.spread_reward import text_reward

    rows, held_out = addition_dataset(seed=0, num_eval=4)
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    trainer = GRPOTrainer(model, opt, GRPOConfig(num_generations=2, beta=0.0))
    config = TrainConfig(
        num_steps=2,
        prompts_per_step=2,
        log_dir=os.path.join(out, "logs"),
        report_to=names,
        log_completions_every=1,
        completions_to_print=0,
        eval_every=1,
        progress=False,
        compile_ahead=False,
    )
    train(
        trainer,
        tok,
        rows[:8],
        [text_reward],
        config,
        RolloutConfig(max_new_tokens=3),
        eval_dataset=held_out,
    )
    if "trackio" in config.report_to:
        from trackio.sqlite_storage import SQLiteStorage

        from artifex.generative_models.training.trackers import DEFAULT_PROJECT

        runs = SQLiteStorage.get_runs(DEFAULT_PROJECT)
        stored = {
            "runs": runs,
            "logs": SQLiteStorage.get_logs(DEFAULT_PROJECT, runs[-1]),
            "config": SQLiteStorage.get_run_config(DEFAULT_PROJECT, runs[-1]),
        }
        with open(os.path.join(out, "trackio.json"), "w", encoding="utf-8") as fh:
            json.dump(stored, fh, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
