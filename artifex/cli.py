"""The ``artifex-grpo`` command.

``artifex-grpo demo`` runs the built-in GRPO example on the CPU and prints the reward before and
after training.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def _bandit_demo(args: argparse.Namespace) -> int:
    """A 10-armed categorical bandit trained with ``GRPOTrainer.train_step``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from artifex.generative_models.training import GRPOConfig, GRPOTrainer

    class Bandit(nnx.Module):
        def __init__(self, arms: int):
            self.logits = nnx.Param(jnp.zeros((arms,)))

        def __call__(self, observations: jax.Array) -> jax.Array:
            return jnp.broadcast_to(self.logits[...], (observations.shape[0], self.logits.shape[0]))

    arms, best, rows = 10, 7, 32
    model = Bandit(arms)
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param),
        GRPOConfig(num_generations=8, beta=0.0),
    )
    key = jax.random.key(args.seed)
    obs = jnp.zeros((rows, 1))
    start = time.perf_counter()
    p0 = float(jax.nn.softmax(model.logits[...])[best])
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        logits = model(obs)
        actions = jax.random.categorical(sub, logits)
        log_probs = jax.nn.log_softmax(logits)[jnp.arange(rows), actions]
        rewards = (actions == best).astype(jnp.float32)
        metrics = trainer.train_step(
            {"observations": obs, "actions": actions, "rewards": rewards, "log_probs": log_probs}
        )
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  reward {metrics['reward_mean']:.3f}  "
                  f"loss {metrics['total_loss']:+.4f}")
    p1 = float(jax.nn.softmax(model.logits[...])[best])
    print(f"P(rewarded arm): before {p0:.3f}, after {p1:.3f} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``artifex-grpo`` command.

    Args:
        argv: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    parser = argparse.ArgumentParser(prog="artifex-grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in GRPO example")
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _bandit_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
