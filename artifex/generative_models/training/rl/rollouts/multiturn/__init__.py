"""Multi-turn rollouts in one place: episodes with tools or environments, as a ``GRPOBatch``.

The feature's modules, in the order a rollout runs them:

- :mod:`~artifex.generative_models.training.rl.rollouts.multiturn.rollout`:
  :class:`MultiTurnRollout`, the rollout stage (same signature as the single-turn
  ``rollout``), and the layout of the flat batch it returns.
- :mod:`~artifex.generative_models.training.rl.rollouts.multiturn.episodes`:
  :class:`MultiTurnConfig` and :func:`run_episodes`, ``G`` episodes per dataset row with the
  KV cache carried across turns, and their per-turn step rewards.
- :mod:`~artifex.generative_models.training.rl.rollouts.multiturn.environments`: the
  :class:`Environment` protocol, :class:`ToolEnvironment` and :func:`environment_reward`.
- :mod:`~artifex.generative_models.training.rl.rollouts.multiturn.tools`: tool schemas,
  tool-call parsing and the guarded :class:`ToolRunner`.
- :mod:`~artifex.generative_models.training.rl.rollouts.multiturn.chat_segments`: the text a
  chat template appends between turns, found from the template itself.

Two pieces live in lower layers because more than multi-turn uses them: the compiled turn
programs (``append_tokens``, ``decode_turn``) are the sampler's, in
:mod:`artifex.generative_models.inference.multiturn`, and the JSON schema of a Python callable is
:mod:`artifex.generative_models.utils.tool_schema` (the tokenizer's chat template reads it too).
The demo of the feature is :mod:`artifex.demos.tools`.

Layer rule: this package is part of ``rollouts`` and imports what ``rollouts`` may (``core``,
``rewards``, the sampler, the models, the generic training modules, the single-turn rollout
modules beside it); never ``update`` or ``run``. The old module paths
(``training.rl.multiturn``, ``training.rl.tools``, ``training.rl.rollouts.tools``,
``.episodes``, ``.environments``) are the same module objects as the new ones.
"""

from artifex.generative_models.training.rl.rollouts.multiturn.rollout import (
    Environment,
    Episodes,
    MultiTurnConfig,
    MultiTurnRollout,
    MultiTurnRolloutResult,
    ToolEnvironment,
    environment_reward,
    run_episodes,
    turn_step_rewards,
)

__all__ = [
    "Environment",
    "Episodes",
    "MultiTurnConfig",
    "MultiTurnRollout",
    "MultiTurnRolloutResult",
    "ToolEnvironment",
    "environment_reward",
    "run_episodes",
    "turn_step_rewards",
]
