r"""Flow trajectories as GRPO batches: the layout, the log-prob hook and the closed-form KL.

A trajectory of ``S`` denoising steps becomes a GRPO "completion" whose tokens are its
**trained** steps (``K`` of them: every SDE step, the SDE window, or a random subset of it;
:attr:`~artifex.generative_models.flow.sde.SDEConfig.num_trained_steps`).
:func:`to_grpo_batch` lays a batch out as

- ``prompt_ids``: the states ``(B, S + 1, D)`` float32, noise first, image last;
- ``completion_ids``: ``(B, K)`` int32, the index ``s`` of each trained transition
  ``x_s -> x_{s+1}`` (ascending);
- ``completion_mask``: ``(B, K)`` ones; ``old_log_probs``: the sampler's log-probs of those
  transitions;
- ``conditioning``: a :class:`FlowConditioning` with the prompts and, as static metadata, the
  sampler settings the trajectories were drawn with.

:class:`FlowLogProbFn` (from :func:`flow_log_prob_fn`) is the ``log_prob_fn`` hook of
``GRPOTrainer``: it gathers the ``B K`` trained transitions and evaluates the model on them only
(the ODE steps and untrained SDE steps cost nothing in the update). Its
:meth:`~FlowLogProbFn.log_probs_and_kl` also returns the exact per-step KL to a reference,

    ``KL_s = ||mu_theta(x_s) - mu_ref(x_s)||^2 / (2 std_s^2)``

(two Gaussians with the same variance), which ``GRPOConfig(kl_estimator="exact")`` uses in
place of a sample estimate.

References:
    Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv:2505.05470; Li et al., 2025, "MixGRPO", arXiv:2507.21802.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.flow.sampling import FlowTrajectory
from artifex.generative_models.flow.sde import (
    SDEConfig,
    gaussian_kl,
    gaussian_log_prob,
    sde_transition,
    time_grid,
)
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "FlowConditioning",
    "FlowLogProbFn",
    "flow_kl",
    "flow_log_prob_fn",
    "to_grpo_batch",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlowConditioning:
    """What a flow batch's log-prob hook needs besides the states: prompts and sampler settings.

    Attributes:
        prompts: ``(B,)`` class labels or ``(B, L)`` token ids.
        sde: The settings the trajectories were sampled with (static metadata, so a hook built
            for other settings is refused when it is traced).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import SDEConfig
        >>> from artifex.generative_models.flow.batch import FlowConditioning
        >>> cond = FlowConditioning(prompts=jnp.array([1, 1]), sde=SDEConfig(num_steps=4))
        >>> cond.prompts.shape, cond.sde.num_steps
        ((2,), 4)
    """

    prompts: jax.Array
    sde: SDEConfig = dataclasses.field(metadata=dict(static=True))


def _trained_steps(
    stochastic: jax.Array, num_trained: int, key: jax.Array | None, subset: bool
) -> jax.Array:
    """``(B, K)`` ascending indices of the trained steps among each row's SDE steps."""
    b, s = stochastic.shape
    if subset:
        scores = jax.random.uniform(key, (b, s))
    else:
        scores = jnp.broadcast_to(jnp.arange(s, dtype=jnp.float32) / s, (b, s))
    scores = jnp.where(stochastic, scores, 2.0)  # the SDE steps first
    return jnp.sort(jnp.argsort(scores, axis=1)[:, :num_trained], axis=1).astype(jnp.int32)


def to_grpo_batch(
    trajectory: FlowTrajectory,
    rewards: Any,
    *,
    group_size: int,
    config: SDEConfig | None = None,
    key: jax.Array | None = None,
    ref_log_probs: jax.Array | None = None,
) -> GRPOBatch:
    """Packs trajectories into a :class:`GRPOBatch` read by :func:`flow_log_prob_fn`.

    The layout is the module's: states in ``prompt_ids``, the ``K`` trained step indices in
    ``completion_ids``, the sampler's log-probs of those steps in ``old_log_probs``, prompts and
    settings in ``conditioning``. The trained steps are the trajectory's SDE steps (all of
    them, or the window); with ``train_steps`` a random subset of that many per row, drawn
    with ``key``.

    Args:
        trajectory: From :class:`~artifex.generative_models.flow.sampling.FlowSampler`
            or :func:`~artifex.generative_models.flow.sampling.sample_flow`
            (``noise_level > 0``).
        rewards: ``(B,)`` rewards of the final images (NaN: no reward).
        group_size: ``G`` generations per prompt (``B`` a multiple of it).
        config: Optional: the settings the caller expects; refused when they differ from the
            trajectory's.
        key: PRNG key choosing the trained steps (needed when ``train_steps`` is set).
        ref_log_probs: Optional ``(B, S)`` reference log-probs of every step (gathered to the
            trained steps).

    Returns:
        The batch.

    Raises:
        TypeError: ``trajectory`` is not a :class:`FlowTrajectory`.
        ValueError: Rewards that are not ``(B,)`` or are infinite, ``B`` not a multiple of
            ``group_size``, ``config`` different from the trajectory's, a trajectory without
            SDE steps (``noise_level == 0``), ``train_steps`` without a ``key``, or
            ``ref_log_probs`` of the wrong shape.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> from artifex.generative_models.flow.batch import to_grpo_batch
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4, window_size=2)
        >>> traj = FlowSampler(sde)(model, [3], 2, jax.random.key(0), window_start=1)
        >>> batch = to_grpo_batch(traj, jnp.array([1.0, 0.0]), group_size=2)
        >>> batch.prompt_ids.shape, batch.completion_ids.tolist()  # states; trained steps
        ((2, 5, 16), [[1, 2], [1, 2]])
    """
    if not isinstance(trajectory, FlowTrajectory):
        msg = f"trajectory must be a FlowTrajectory, got {type(trajectory).__name__}"
        raise TypeError(msg)
    sde = trajectory.config
    if config is not None and config != sde:
        msg = f"config {config} differs from the settings the trajectory was sampled with {sde}"
        raise ValueError(msg)
    if sde.noise_level == 0.0:
        msg = "to_grpo_batch needs SDE trajectories (noise_level > 0): ODE steps have no density"
        raise ValueError(msg)
    b, s = np.shape(trajectory.log_probs)
    g = check_int("group_size", group_size, minimum=1)
    rewards = np.asarray(rewards, np.float32) if not isinstance(rewards, jax.Array) else rewards
    if tuple(np.shape(rewards)) != (b,):
        msg = f"rewards must have shape ({b},) (one per trajectory), got {np.shape(rewards)}"
        raise ValueError(msg)
    if not isinstance(rewards, jax.core.Tracer) and np.isinf(np.asarray(rewards)).any():
        msg = f"rewards must be finite or NaN (no reward), got {np.asarray(rewards).tolist()}"
        raise ValueError(msg)
    if b % g:
        msg = f"{b} trajectories are not a multiple of group_size {g}"
        raise ValueError(msg)
    subset = sde.num_trained_steps < sde.num_stochastic_steps
    if subset and key is None:
        msg = "to_grpo_batch needs a key to choose SDEConfig.train_steps steps per row"
        raise ValueError(msg)
    steps = _trained_steps(jnp.asarray(trajectory.stochastic), sde.num_trained_steps, key, subset)
    old = jnp.take_along_axis(jnp.asarray(trajectory.log_probs, jnp.float32), steps, axis=1)
    if ref_log_probs is not None:
        if tuple(np.shape(ref_log_probs)) != (b, s):
            msg = f"ref_log_probs must have shape ({b}, {s}), got {np.shape(ref_log_probs)}"
            raise ValueError(msg)
        ref_log_probs = jnp.take_along_axis(jnp.asarray(ref_log_probs, jnp.float32), steps, 1)
    return GRPOBatch(
        prompt_ids=jnp.asarray(trajectory.states, jnp.float32),
        completion_ids=steps,
        completion_mask=jnp.ones(steps.shape, jnp.float32),
        rewards=jnp.asarray(rewards, jnp.float32),
        old_log_probs=old,
        ref_log_probs=ref_log_probs,
        conditioning=FlowConditioning(prompts=jnp.asarray(trajectory.prompts), sde=sde),
        group_size=g,
    )


class FlowLogProbFn:
    """The ``log_prob_fn`` hook of ``GRPOTrainer`` for flow batches, with the exact KL.

    ``fn(model, batch) -> (log_probs, entropy)``: the log-density of each trained transition
    under ``model`` and its entropy ``D/2 log(2 pi e std^2)`` (independent of the parameters),
    both ``(B, K)``. :meth:`log_probs_and_kl` adds the closed-form KL to a reference. Built by
    :func:`flow_log_prob_fn`.

    Args:
        config: The sampler settings (``noise_level > 0``); a batch sampled with another
            ``num_steps`` or ``noise_level`` is refused.

    Raises:
        TypeError: ``config`` is not an ``SDEConfig``.
        ValueError: ``noise_level`` is 0 (the ODE has no density).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> from artifex.generative_models.flow.batch import (
        ...     FlowLogProbFn, to_grpo_batch)
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=6, window_size=2)  # 2 SDE steps, 4 ODE steps
        >>> batch = to_grpo_batch(FlowSampler(sde)(model, [3], 2, jax.random.key(0)),
        ...                       jnp.array([1.0, 0.0]), group_size=2)
        >>> logp, entropy, kl = FlowLogProbFn(sde).log_probs_and_kl(model, model, batch)
        >>> logp.shape, float(kl.max())  # the window's 2 steps; the same model: KL 0
        ((2, 2), 0.0)
    """

    def __init__(self, config: SDEConfig):
        if not isinstance(config, SDEConfig):
            msg = f"config must be an SDEConfig, got {type(config).__name__}"
            raise TypeError(msg)
        if config.noise_level == 0.0:
            msg = "flow_log_prob_fn needs SDEConfig.noise_level > 0 (the ODE has no density)"
            raise ValueError(msg)
        self.config = config

    def _check(self, batch: GRPOBatch) -> FlowConditioning:
        cond = batch.conditioning
        if not isinstance(cond, FlowConditioning):
            msg = (
                "a flow batch needs GRPOBatch.conditioning = FlowConditioning (built by "
                f"to_grpo_batch), got {type(cond).__name__}"
            )
            raise TypeError(msg)
        mine, theirs = self.config, cond.sde
        if (mine.num_steps, mine.noise_level) != (theirs.num_steps, theirs.noise_level):
            msg = (
                f"the batch's trajectories were sampled with num_steps={theirs.num_steps}, "
                f"noise_level={theirs.noise_level}, but this log-prob function computes "
                f"transitions for num_steps={mine.num_steps}, noise_level={mine.noise_level}"
            )
            raise ValueError(msg)
        return cond

    def _means(self, model: Any, batch: GRPOBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(mu, std, x_next)`` of the ``B K`` trained transitions (``std`` is ``(B, K, 1)``)."""
        cond = self._check(batch)
        states = jnp.asarray(batch.prompt_ids, jnp.float32)
        steps = jnp.asarray(batch.completion_ids, jnp.int32)
        b, k = steps.shape
        d = states.shape[-1]
        x = jnp.take_along_axis(states, steps[..., None], axis=1).reshape(b * k, d)
        x_next = jnp.take_along_axis(states, steps[..., None] + 1, axis=1)
        prompts = jnp.repeat(jnp.asarray(cond.prompts, jnp.int32), k, axis=0)
        grid = jnp.asarray(time_grid(self.config.num_steps))
        flat = steps.reshape(-1)
        t = grid[flat]
        v = jnp.asarray(model(x, t, prompts), jnp.float32)
        t_cap = float(time_grid(self.config.num_steps)[1])
        mu, std = sde_transition(
            x, v, t[:, None], grid[flat + 1][:, None], t_cap, self.config.noise_level
        )
        return mu.reshape(b, k, d), std.reshape(b, k, 1), x_next

    def _outputs(self, mu: jax.Array, std: jax.Array, x_next: jax.Array):
        log_probs = gaussian_log_prob(x_next, mu, std)
        d = x_next.shape[-1]
        entropy = 0.5 * d * jnp.log(2.0 * math.pi * math.e * std[..., 0] ** 2)
        return log_probs, jnp.broadcast_to(entropy, log_probs.shape)

    def __call__(self, model: Any, batch: GRPOBatch) -> tuple[jax.Array, jax.Array]:
        """Log-probs and entropies ``(B, K)`` of the trained transitions under ``model``.

        Args:
            model: The velocity network.
            batch: From :func:`to_grpo_batch`.

        Returns:
            ``(log_probs, entropy)``.
        """
        return self._outputs(*self._means(model, batch))

    def log_probs_and_kl(
        self, model: Any, reference: Any, batch: GRPOBatch
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Log-probs, entropies and the exact per-step KL to ``reference``, all ``(B, K)``.

        ``KL_s = ||mu_theta - mu_ref||^2 / (2 std_s^2)`` with the reference's means not
        differentiated. The model runs once on the trained transitions (and the reference
        once).

        Args:
            model: The policy.
            reference: The reference velocity network.
            batch: From :func:`to_grpo_batch`.

        Returns:
            ``(log_probs, entropy, kl)``.
        """
        mu, std, x_next = self._means(model, batch)
        mu_ref, _, _ = self._means(reference, batch)
        log_probs, entropy = self._outputs(mu, std, x_next)
        return log_probs, entropy, gaussian_kl(mu, jax.lax.stop_gradient(mu_ref), std)


def flow_log_prob_fn(config: SDEConfig) -> FlowLogProbFn:
    """The log-prob hook for ``GRPOTrainer``/``make_grpo_loss`` on flow trajectories.

    Args:
        config: The sampler settings (``noise_level > 0``).

    Returns:
        A :class:`FlowLogProbFn`: ``fn(model, batch) -> (log_probs, entropy)``, with
        ``fn.log_probs_and_kl`` for ``GRPOConfig(kl_estimator="exact")``.

    Raises:
        ValueError: ``noise_level`` is 0 (the ODE has no density).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> from artifex.generative_models.flow.batch import (
        ...     flow_log_prob_fn, to_grpo_batch)
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4)
        >>> traj = FlowSampler(sde)(model, [3], 2, jax.random.key(0))
        >>> batch = to_grpo_batch(traj, jnp.array([1.0, 0.0]), group_size=2)
        >>> logp, entropy = flow_log_prob_fn(sde)(model, batch)
        >>> logp.shape, bool(jnp.allclose(logp, traj.log_probs, atol=1e-4))  # the sampler's
        ((2, 4), True)
    """
    return FlowLogProbFn(config)


def flow_kl(model: Any, ref_model: Any, batch: GRPOBatch, config: SDEConfig) -> jax.Array:
    r"""Closed-form per-step KL between the policy's and the reference's transitions.

    ``KL_s = ||mu_theta(x_s) - mu_ref(x_s)||^2 / (2 std_s^2)`` at every trained transition;
    the two share ``std_s``.

    Args:
        model: The policy.
        ref_model: The reference.
        batch: A batch from :func:`to_grpo_batch`.
        config: The sampler settings.

    Returns:
        ``(B, K)`` float32 KL divergences.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> from artifex.generative_models.flow.batch import flow_kl, to_grpo_batch
        >>> cfg = FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1, time_features=8)
        >>> model = FlowModel(cfg, rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4)
        >>> batch = to_grpo_batch(FlowSampler(sde)(model, [3], 2, jax.random.key(0)),
        ...                       jnp.array([1.0, 0.0]), group_size=2)
        >>> float(flow_kl(model, model, batch, sde).max())  # the same means: no divergence
        0.0
        >>> ref = nnx.clone(model)
        >>> nnx.update(ref, jax.tree.map(lambda p: p + 0.01, nnx.state(ref, nnx.Param)))
        >>> bool((flow_kl(model, ref, batch, sde) > 0).all())
        True
    """
    return FlowLogProbFn(config).log_probs_and_kl(model, ref_model, batch)[2]
