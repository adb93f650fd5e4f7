"""What the training loop checks before it starts, and the diagnosis after its first step.

:func:`check_train_settings` refuses, before any sampling or compiling, the settings of a run
that cannot work (batch sizes that do not split, settings that do not combine, dataset rows
without a prompt, a tokenizer larger than the model's vocabulary).
:func:`reward_signal_diagnosis` says after the first step why a batch cannot teach anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.advantages import nonconstant_groups
from artifex.generative_models.training.rl.core.policy import Policy
from artifex.generative_models.training.rl.rollouts.rollout import (
    RolloutConfig,
    check_engine_rollout,
    spans_processes,
)
from artifex.generative_models.training.rl.rollouts.step_rewards import StepRewards
from artifex.generative_models.training.rl.run.evaluation import (
    EVAL_BATCH_SIZE,
    check_eval_row_groups,
)
from artifex.generative_models.training.rl.run.evaluation_metrics import check_sampled_eval
from artifex.generative_models.utils.validation import check_int

__all__ = ["check_tokenizer_fits", "check_train_settings", "reward_signal_diagnosis"]


def check_train_settings(
    config: Any,
    rcfg: RolloutConfig,
    policy: Policy,
    tokenizer: Any,
    dataset: Sequence[Mapping[str, Any]],
    *,
    eval_dataset: Sequence[Mapping[str, Any]] | None = None,
    rollout_fn: Callable[..., Any] | None = None,
    evaluate_fn: Callable[..., Any] | None = None,
    rollout_placement: Any = None,
    rollout_engine: Any = None,
    step_rewards: StepRewards | None = None,
) -> None:
    """Raises unless the settings of a run work together (what ``train`` checks first).

    Args:
        config: The ``TrainConfig``.
        rcfg: The ``RolloutConfig``.
        policy: The trainer's policy (its group size, mesh, model and ``GRPOConfig``).
        tokenizer: The tokenizer.
        dataset: The training rows.
        eval_dataset: The evaluation rows (``None``: none).
        rollout_fn: A custom rollout function (``None``: the library's rollout).
        evaluate_fn: A custom evaluation function (``None``: the library's).
        rollout_placement: A rollout placement (``None``: none).
        rollout_engine: A rollout engine (``None``: the library's sampler).
        step_rewards: Per-step rewards (``None``: none).

    Raises:
        ValueError: Naming the settings that do not work together and their values.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import GRPOConfig, RolloutConfig, TrainConfig
        >>> from artifex.generative_models.training.rl import Policy
        >>> from artifex.generative_models.training.rl.run.checks import check_train_settings
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=3))
        >>> check_train_settings(TrainConfig(num_steps=1, prompts_per_step=2, num_minibatches=4),
        ...                      RolloutConfig(), policy, tok, [{"prompt": "1+1="}])
        Traceback (most recent call last):
            ...
        ValueError: the 6 rows of a generation batch (prompts_per_step * num_generations) ...
    """
    rows_per_batch = config.prompts_per_step * policy.config.num_generations
    per_update = rows_per_batch // config.num_minibatches
    if rows_per_batch % config.num_minibatches or per_update % (
        config.gradient_accumulation_steps or 1
    ):
        msg = (
            f"the {rows_per_batch} rows of a generation batch (prompts_per_step * "
            f"num_generations) must split into num_minibatches={config.num_minibatches} "
            f"updates of gradient_accumulation_steps={config.gradient_accumulation_steps} "
            "equal microbatches"
        )
        raise ValueError(msg)
    if rollout_fn is None and rcfg.row_groups is not None:
        if config.prompts_per_step % rcfg.row_groups:
            msg = (
                f"RolloutConfig.row_groups={rcfg.row_groups} must divide the prompts of a step "
                f"(TrainConfig.prompts_per_step={config.prompts_per_step})"
            )
            raise ValueError(msg)
        sampling_mesh = policy.mesh if rollout_placement is None else rollout_placement.mesh
        if rcfg.row_groups > 1 and sampling_mesh is not None and sampling_mesh.devices.size > 1:
            msg = (
                f"RolloutConfig.row_groups={rcfg.row_groups} needs the prompts on one device; "
                f"the rollout samples on a mesh of {sampling_mesh.devices.size} devices, which "
                "spreads the rows over them already (leave it None or 1)"
            )
            raise ValueError(msg)
    if eval_dataset is not None and evaluate_fn is None:
        check_eval_row_groups(rcfg, len(eval_dataset), EVAL_BATCH_SIZE)
    if config.eval_num_samples > 1 and eval_dataset is None:
        msg = f"TrainConfig.eval_num_samples={config.eval_num_samples} needs an eval_dataset"
        raise ValueError(msg)
    check_sampled_eval(
        config.eval_num_samples,
        custom_evaluate=evaluate_fn is not None,
        mesh=policy.mesh,
        rollout_config=rcfg,
    )
    length = policy.config.max_completion_length
    if rollout_fn is None and length is not None and length != rcfg.max_new_tokens:
        msg = (
            f"GRPOConfig.max_completion_length={length} and RolloutConfig.max_new_tokens="
            f"{rcfg.max_new_tokens} describe one length (the completions' width): leave "
            "max_completion_length unset (it is derived from the batch) or make them equal"
        )
        raise ValueError(msg)
    prompt_column = rcfg.prompt_column
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping) or prompt_column not in row:
            msg = f"dataset row {i} has no prompt column {prompt_column!r}"
            raise ValueError(msg)

    check_tokenizer_fits(tokenizer, policy.model)
    if rollout_engine is not None:  # an external engine samples (inference/engines)
        if rollout_fn is not None or rollout_placement is not None:
            msg = (
                "train(rollout_engine=...) samples the single-turn rollout with the engine; it "
                "does not combine with a custom rollout_fn (multi-turn) or a rollout_placement"
            )
            raise ValueError(msg)
        check_engine_rollout(rcfg, policy.mesh)
    if step_rewards is not None and rollout_fn is not None:  # step_rewards.py: single-turn
        msg = (
            "train(step_rewards=...) scores the single-turn rollout's text; a custom "
            "rollout_fn (multi-turn) places its own (MultiTurnConfig.turn_rewards_as_step_"
            "rewards)"
        )
        raise ValueError(msg)
    if spans_processes(policy.mesh) and config.dynamic_sampling:
        msg = (
            "TrainConfig.dynamic_sampling is not supported on a mesh spanning several processes "
            "yet (its group filtering is host-side); got dynamic_sampling=True"
        )
        raise ValueError(msg)


def check_tokenizer_fits(tokenizer: Any, model: Any) -> None:
    """Checks that every id the tokenizer can produce is in the model's vocabulary.

    A tokenizer with more ids than the model's embedding table would produce token ids the
    gathers clamp silently. Models without a ``config.vocab_size`` (or tokenizers without a
    ``vocab_size``) are not checked.

    Args:
        tokenizer: The tokenizer (``vocab_size``, added tokens included).
        model: The policy (``config.vocab_size``).

    Raises:
        ValueError: The tokenizer has more ids than the model's vocabulary.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training.rl.run.checks import check_tokenizer_fits
        >>> tok = Tokenizer.for_characters("0123456789+=")  # 16 ids
        >>> cfg = CausalLMConfig(vocab_size=12, hidden_size=8, intermediate_size=16, num_layers=1,
        ...                      num_heads=2)
        >>> check_tokenizer_fits(tok, CausalLM(cfg, rngs=nnx.Rngs(0)))
        Traceback (most recent call last):
            ...
        ValueError: the tokenizer has 16 token ids but the model's vocabulary has only 12 ...
        >>> check_tokenizer_fits(tok, CausalLM(cfg.replace(vocab_size=16), rngs=nnx.Rngs(0)))
    """
    tok_size = getattr(tokenizer, "vocab_size", None)
    model_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(tok_size, int) or not isinstance(model_size, int):
        return
    if tok_size > model_size:
        msg = (
            f"the tokenizer has {tok_size} token ids but the model's vocabulary has only "
            f"{model_size} (config.vocab_size): use the tokenizer saved with this model"
        )
        raise ValueError(msg)


def reward_signal_diagnosis(rewards: Sequence[float] | Any, group_size: int) -> str | None:
    """One line saying why a generation batch cannot teach the policy anything, or ``None``.

    GRPO learns from differences between the rewards of one prompt's completions (groups are
    tested by
    :func:`~artifex.generative_models.training.rl.core.group_statistics.nonconstant_groups`): a
    batch whose rewards are all 0, or whose every group of ``group_size`` completions got one
    same reward, has advantages that are all 0 and gives no gradient. The training loop prints
    this line after its first step.

    Args:
        rewards: The ``(B,)`` rewards of a batch, row ``i`` of prompt ``i // group_size``
            (NaN or None: no reward).
        group_size: Completions per prompt ``G``; ``B`` must be a multiple of it.

    Returns:
        ``"no reward signal: ..."`` with what to check, or ``None`` when some group's rewards
        differ.

    Raises:
        ValueError: ``group_size`` is not a positive int that divides the number of rewards.

    Examples:
        >>> from artifex.generative_models.training.rl.run.checks import reward_signal_diagnosis
        >>> print(reward_signal_diagnosis([0.0, 0.0, 0.0, 0.0], group_size=2))
        no reward signal: every reward is 0 (4 completions of 2 prompts)...
        >>> print(reward_signal_diagnosis([1.0, 1.0, 0.0, 0.0], group_size=2))
        no reward signal: every group of 2 completions has the same reward ...
        >>> reward_signal_diagnosis([1.0, 0.0, 0.0, 0.0], group_size=2) is None
        True
    """
    r = np.asarray([np.nan if v is None else v for v in np.asarray(rewards, object).ravel()], float)
    group_size = check_int("group_size", group_size, minimum=1)
    if r.size % group_size:
        msg = f"{r.size} rewards do not split into groups of group_size={group_size}"
        raise ValueError(msg)
    prompts = r.size // group_size
    where = f"({r.size} completions of {prompts} prompts)"
    valid = ~np.isnan(r)
    if not valid.any():
        return (
            f"no reward signal: no completion got a reward {where}, every reward function "
            "returned None: check that the dataset has the columns the reward functions read"
        )
    if np.all(r[valid] == 0):
        return (
            f"no reward signal: every reward is 0 {where}, so every advantage is 0 and "
            "nothing is learned: look at a few completions (log_completions_every, "
            "--log-completions-every 1) and check the reward functions and the answer column, "
            "or use easier prompts or a reward that gives partial credit (e.g. format)"
        )
    if bool(np.any(nonconstant_groups(jnp.asarray(r, jnp.float32), group_size))):
        return None
    values = ", ".join(f"{v:g}" for v in np.unique(r[valid])[:5])
    return (
        f"no reward signal: every group of {group_size} completions has the same reward "
        f"{where}, rewards seen: {values} (all advantages are 0): raise num_generations or the "
        "sampling temperature for more varied completions, or use a reward that grades "
        "partial success"
    )
