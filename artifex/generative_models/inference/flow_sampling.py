r"""ODE and SDE samplers for flow-matching image models, with exact per-step log-probs.

Rectified flow samples by integrating ``dx = v_theta(x_t, t) dt`` from ``t = 1`` (noise) to
``t = 0`` (data). Flow-GRPO turns this ODE into an SDE with the same marginals,

    ``dx = [v_theta(x_t, t) + sigma_t^2 / (2 t) (x_t + (1 - t) v_theta(x_t, t))] dt
    + sigma_t dw``,     ``sigma_t = a sqrt(t / (1 - t))``

(``a`` the noise level), and discretizes it with Euler-Maruyama on the grid
``t_s = 1 - s / S`` (``dt = t_{s+1} - t_s < 0``). Each step is then a Gaussian transition

    ``x_{s+1} ~ N(mu_theta(x_s, t_s), std_s^2 I)``,
    ``mu = x_s + [v + sigma_{t_s}^2 / (2 t_s) (x_s + (1 - t_s) v)] dt``,
    ``std_s = sigma_{t_s} sqrt(-dt)``,

whose log-density is exact: ``log p = -||x_{s+1} - mu||^2 / (2 std^2) - D log std
- (D / 2) log(2 pi)`` for ``D`` pixels. A denoising trajectory of ``S`` steps is a
"completion" of length ``S`` whose per-step log-probs play the role of per-token log-probs in
GRPO (:func:`flow_log_prob_fn` plugs them into ``GRPOTrainer`` unchanged). At ``t = 1``,
where ``sigma_t`` is infinite, ``1 - t`` is replaced by ``1 - t_1`` (as in the paper's code).
With ``a = 0`` the SDE sampler is the Euler ODE sampler.

Two transitions with the same variance (policy and reference from the same state) have the
closed-form KL ``KL = ||mu_theta - mu_ref||^2 / (2 std^2)`` (:func:`gaussian_kl`).

References:
    Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv:2505.05470; Xue et al., 2025, "DanceGRPO: Unleashing GRPO on Visual Generation",
    arXiv:2505.07818; Lipman et al., 2022, arXiv:2210.02747; Liu et al., 2022,
    arXiv:2209.03003.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.logprobs import LogProbFn
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "FlowSampler",
    "FlowTrajectory",
    "SDEConfig",
    "flow_kl",
    "flow_log_prob_fn",
    "gaussian_kl",
    "gaussian_log_prob",
    "sample_flow",
    "sde_step",
    "sde_transition",
    "time_grid",
    "to_grpo_batch",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SDEConfig:
    """Settings of the Flow-GRPO sampler.

    Attributes:
        num_steps: Denoising steps ``S`` (the "completion length").
        noise_level: ``a`` in ``sigma_t = a sqrt(t / (1 - t))``; 0 gives the Euler ODE sampler.
        train_steps: How many of the ``S`` steps of each trajectory are trained (chosen at
            random per trajectory, as Flow-GRPO trains on a fraction of the timesteps);
            ``None`` trains all.

    Examples:
        >>> from artifex.generative_models.inference import SDEConfig
        >>> sde = SDEConfig(num_steps=10, noise_level=0.7, train_steps=4)
        >>> sde.num_steps, sde.train_steps, SDEConfig(noise_level=0.0).noise_level  # 0: the ODE
        (10, 4, 0.0)
    """

    num_steps: int = 10
    noise_level: float = 0.7
    train_steps: int | None = None

    def __post_init__(self) -> None:
        check_int("SDEConfig.num_steps", self.num_steps, minimum=2)
        if not (math.isfinite(self.noise_level) and self.noise_level >= 0):
            msg = f"SDEConfig.noise_level must be finite and >= 0, got {self.noise_level}"
            raise ValueError(msg)
        check_int(
            "SDEConfig.train_steps",
            self.train_steps,
            minimum=1,
            maximum=self.num_steps,
            allow_none=True,
        )


def time_grid(num_steps: int) -> np.ndarray:
    """The ``S + 1`` times ``t_s = 1 - s / S`` from noise (1) to data (0).

    Args:
        num_steps: ``S``.

    Returns:
        ``(S + 1,)`` float32.

    Examples:
        >>> from artifex.generative_models.inference import time_grid
        >>> time_grid(4).tolist()
        [1.0, 0.75, 0.5, 0.25, 0.0]
    """
    return (1.0 - np.arange(num_steps + 1, dtype=np.float64) / num_steps).astype(np.float32)


def sde_transition(
    x: jax.Array, v: jax.Array, t: jax.Array, t_next: jax.Array, t_cap: float, noise_level: float
) -> tuple[jax.Array, jax.Array]:
    r"""Mean and standard deviation of one Euler-Maruyama step of the Flow-GRPO SDE.

    ``sigma = a sqrt(t / (1 - min(t, t_cap)))``, ``dt = t_next - t``,
    ``mu = x + [v + sigma^2 / (2 t) (x + (1 - t) v)] dt``, ``std = sigma sqrt(-dt)``.

    Args:
        x: ``(..., D)`` current states.
        v: ``(..., D)`` velocities ``v_theta(x, t)``.
        t: Current times, broadcastable to ``x[..., :1]`` (``0 < t <= 1``).
        t_next: Next times (``< t``).
        t_cap: Largest ``t`` used in ``1 - t`` (the first grid step below 1).
        noise_level: ``a``.

    Returns:
        ``(mu, std)``: ``(..., D)`` means and standard deviations broadcastable to them.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.inference import sde_transition
        >>> x, v = jnp.zeros((1, 2)), jnp.ones((1, 2))
        >>> mu, std = sde_transition(x, v, jnp.array([[0.5]]), jnp.array([[0.25]]), 0.9, 0.0)
        >>> mu.tolist(), std.tolist()  # noise_level 0: the Euler step x + v dt, no noise
        ([[-0.25, -0.25]], [[0.0]])
    """
    x = jnp.asarray(x, jnp.float32)
    v = jnp.asarray(v, jnp.float32)
    dt = t_next - t
    sigma = noise_level * jnp.sqrt(t / (1.0 - jnp.minimum(t, t_cap)))
    mu = x + (v + sigma**2 / (2.0 * t) * (x + (1.0 - t) * v)) * dt
    return mu, sigma * jnp.sqrt(-dt)


def gaussian_log_prob(x: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    r"""Log-density of ``N(mean, std^2 I)`` at ``x``, summed over the last axis.

    ``log p = sum_d [-(x_d - mu_d)^2 / (2 std^2) - log std - log(2 pi) / 2]``.

    Args:
        x: ``(..., D)`` points.
        mean: ``(..., D)`` means.
        std: Standard deviations broadcastable to ``x`` (``> 0``).

    Returns:
        ``(...)`` float32 log-densities.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.inference import gaussian_log_prob
        >>> logp = gaussian_log_prob(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 1)))
        >>> round(float(logp[0]), 4)  # -log(2 pi) for a 2-d standard normal at its mean
        -1.8379
    """
    x = jnp.asarray(x, jnp.float32)
    std = jnp.broadcast_to(jnp.asarray(std, jnp.float32), x.shape)
    z = (x - mean) / std
    return jnp.sum(-0.5 * z * z - jnp.log(std) - 0.5 * math.log(2.0 * math.pi), axis=-1)


def gaussian_kl(mean: jax.Array, ref_mean: jax.Array, std: jax.Array) -> jax.Array:
    r"""``KL[N(mean, std^2 I) || N(ref_mean, std^2 I)] = ||mean - ref_mean||^2 / (2 std^2)``.

    Args:
        mean: ``(..., D)`` policy means.
        ref_mean: ``(..., D)`` reference means.
        std: Shared standard deviations, broadcastable to ``(..., 1)`` (``> 0``).

    Returns:
        ``(...)`` float32 KL divergences.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.inference import gaussian_kl
        >>> gaussian_kl(jnp.array([[1.0, 0.0]]), jnp.zeros((1, 2)), jnp.array([[0.5]])).tolist()
        [2.0]
    """
    diff = jnp.asarray(mean, jnp.float32) - jnp.asarray(ref_mean, jnp.float32)
    std = jnp.asarray(std, jnp.float32)
    return jnp.sum(diff * diff / (2.0 * std * std), axis=-1)


def sde_step(
    model: Any,
    x: jax.Array,
    labels: jax.Array,
    step: jax.Array,
    config: SDEConfig,
) -> tuple[jax.Array, jax.Array]:
    """Transition mean and std of step ``step`` (from ``t_step`` to ``t_{step+1}``) under ``model``.

    Args:
        model: ``model(x, t, labels) -> v`` on flattened images.
        x: ``(N, D)`` states at step ``step``.
        labels: ``(N,)`` int class prompts.
        step: ``(N,)`` int step indices in ``[0, S)``.
        config: Sampler settings.

    Returns:
        ``(mu, std)``: ``(N, D)`` means and ``(N, 1)`` standard deviations.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import SDEConfig, sde_step
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> mu, std = sde_step(model, jnp.zeros((2, 16)), jnp.array([3, 7]), jnp.array([0, 1]),
        ...                    SDEConfig(num_steps=4))
        >>> mu.shape, std.shape, bool((std > 0).all())
        ((2, 16), (2, 1), True)
    """
    host_grid = time_grid(config.num_steps)
    grid = jnp.asarray(host_grid)
    t = grid[step]
    v = model(x, t, labels)
    return sde_transition(
        x, v, t[:, None], grid[step + 1][:, None], float(host_grid[1]), config.noise_level
    )


class FlowTrajectory(NamedTuple):
    """Sampled denoising trajectories.

    Attributes:
        states: ``(B, S + 1, D)`` states from noise (index 0) to the image (index ``S``).
        log_probs: ``(B, S)`` log-densities of each transition (0 when ``noise_level == 0``).
        labels: ``(B,)`` class prompts.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import FlowSampler, SDEConfig
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> traj = FlowSampler(SDEConfig(num_steps=4))(model, [3], 2, jax.random.key(0))
        >>> traj.states.shape, traj.log_probs.shape, traj.images.shape, traj.labels.tolist()
        ((2, 5, 16), (2, 4), (2, 16), [3, 3])
    """

    states: jax.Array
    log_probs: jax.Array
    labels: jax.Array

    @property
    def images(self) -> jax.Array:
        """The final samples ``(B, D)`` (flattened)."""
        return self.states[:, -1]


def sample_flow(
    model: Any, labels: jax.Array, noise: jax.Array, config: SDEConfig
) -> FlowTrajectory:
    """Samples trajectories with the SDE (or, at ``noise_level == 0``, the Euler ODE).

    Deterministic given ``noise``: ``noise[:, 0]`` is the starting point ``x_{t=1}``,
    ``noise[:, s + 1]`` the standard normal draw of step ``s``.

    Args:
        model: ``model(x, t, labels) -> v`` on flattened images.
        labels: ``(B,)`` int class prompts.
        noise: ``(B, S + 1, D)`` standard normal draws.
        config: Sampler settings.

    Returns:
        The :class:`FlowTrajectory`.

    Raises:
        ValueError: ``noise`` does not have ``S + 1`` steps.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import SDEConfig, sample_flow
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> noise = jax.random.normal(jax.random.key(0), (2, 5, 16))  # (B, S + 1, D)
        >>> traj = sample_flow(model, jnp.array([1, 2]), noise, SDEConfig(num_steps=4))
        >>> traj.states.shape, bool(jnp.allclose(traj.states[:, 0], noise[:, 0]))
        ((2, 5, 16), True)
        >>> ode = sample_flow(model, jnp.array([1, 2]), noise,
        ...                   SDEConfig(num_steps=4, noise_level=0.0))
        >>> float(jnp.abs(ode.log_probs).max())  # the ODE has no transition densities
        0.0
    """
    b, s1, _ = noise.shape
    if s1 != config.num_steps + 1:
        msg = f"noise must have shape (B, {config.num_steps + 1}, D), got {noise.shape}"
        raise ValueError(msg)
    labels = jnp.asarray(labels, jnp.int32)

    def body(x: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple]:
        s, eps = xs
        mu, std = sde_step(model, x, labels, jnp.full((b,), s), config)
        if config.noise_level == 0.0:
            return mu, (mu, jnp.zeros((b,), jnp.float32))
        x_next = mu + std * eps
        return x_next, (x_next, gaussian_log_prob(x_next, mu, std))

    x0 = jnp.asarray(noise[:, 0], jnp.float32)
    eps = jnp.moveaxis(jnp.asarray(noise[:, 1:], jnp.float32), 1, 0)
    _, (xs, lps) = jax.lax.scan(body, x0, (jnp.arange(config.num_steps), eps))
    states = jnp.concatenate([x0[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
    return FlowTrajectory(states, jnp.moveaxis(lps, 0, 1), labels)


class FlowSampler:
    """A compiled :func:`sample_flow` shell: ``K`` images per class prompt.

    Rows are prompt-major: row ``i`` belongs to prompt ``i // K``, generation ``i % K``.

    Args:
        config: Sampler settings.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import FlowSampler, SDEConfig
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sampler = FlowSampler(SDEConfig(num_steps=4))
        >>> traj = sampler(model, [3, 5], 4, jax.random.key(0))  # 4 images per class prompt
        >>> traj.labels.tolist(), sampler.num_compilations
        ([3, 3, 3, 3, 5, 5, 5, 5], 1)
    """

    def __init__(self, config: SDEConfig):
        if not isinstance(config, SDEConfig):
            msg = f"config must be an SDEConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.config = config
        self._num_traces = 0
        self._fn = jax.jit(self._sample, static_argnums=(0,))

    @property
    def num_compilations(self) -> int:
        """How many times the sampler has been traced (one per model graph and shape)."""
        return self._num_traces

    def _sample(self, graphdef: Any, state: nnx.State, labels: jax.Array, noise: jax.Array):
        self._num_traces += 1
        return sample_flow(nnx.merge(graphdef, state), labels, noise, self.config)

    def __call__(
        self, model: nnx.Module, prompts: Any, num_generations: int, key: jax.Array
    ) -> FlowTrajectory:
        """Samples ``num_generations`` trajectories per class prompt.

        Row ``i`` belongs to prompt ``i // K``, generation ``i % K``.

        Args:
            model: The velocity network (``model.config.data_dim`` pixels).
            prompts: ``(P,)`` int class prompts.
            num_generations: ``K``.
            key: PRNG key.

        Returns:
            The :class:`FlowTrajectory` of ``P * K`` rows.
        """
        labels = jnp.repeat(jnp.asarray(prompts, jnp.int32), num_generations)
        d = model.config.data_dim
        noise = jax.random.normal(key, (labels.shape[0], self.config.num_steps + 1, d))
        graphdef, state = nnx.split(model)
        return self._fn(graphdef, state, labels, noise)


def to_grpo_batch(
    trajectory: FlowTrajectory,
    rewards: jax.Array | np.ndarray,
    *,
    group_size: int,
    config: SDEConfig,
    key: jax.Array | None = None,
    ref_log_probs: jax.Array | None = None,
) -> GRPOBatch:
    """Packs trajectories into a :class:`GRPOBatch` read by :func:`flow_log_prob_fn`.

    Layout: ``prompt_ids`` holds the states ``(B, S + 1, D)`` (float32), ``completion_ids``
    the class prompt at each of the ``S`` steps ``(B, S)`` (int32), ``completion_mask`` 1 on
    the trained steps (``config.train_steps`` drawn at random per row with ``key``, or all),
    ``old_log_probs`` the sampler's log-probs (on the trained steps).

    Args:
        trajectory: From :class:`FlowSampler` or :func:`sample_flow` (``noise_level > 0``).
        rewards: ``(B,)`` rewards of the final images.
        group_size: ``K`` generations per prompt.
        config: The sampler settings the trajectories were drawn with.
        key: PRNG key choosing the trained steps (needed when ``train_steps`` is set).
        ref_log_probs: Optional ``(B, S)`` reference log-probs.

    Returns:
        The batch.

    Raises:
        ValueError: ``train_steps`` is set without a ``key``, or shapes disagree.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import FlowSampler, SDEConfig, to_grpo_batch
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4, train_steps=2)
        >>> traj = FlowSampler(sde)(model, [3], 2, jax.random.key(0))
        >>> batch = to_grpo_batch(traj, jnp.array([1.0, 0.0]), group_size=2, config=sde,
        ...                       key=jax.random.key(1))
        >>> batch.prompt_ids.shape, batch.completion_mask.sum(axis=1).tolist()
        ((2, 5, 16), [2.0, 2.0])
    """
    b, s = trajectory.log_probs.shape
    if s != config.num_steps:
        msg = f"trajectory has {s} steps but config.num_steps is {config.num_steps}"
        raise ValueError(msg)
    if config.train_steps is None or config.train_steps == s:
        mask = jnp.ones((b, s), jnp.float32)
    else:
        if key is None:
            msg = "to_grpo_batch needs a key to choose SDEConfig.train_steps steps per row"
            raise ValueError(msg)
        ranks = jnp.argsort(jax.random.uniform(key, (b, s)), axis=1).argsort(axis=1)
        mask = (ranks < config.train_steps).astype(jnp.float32)
    labels = jnp.asarray(trajectory.labels, jnp.int32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(trajectory.states, jnp.float32),
        completion_ids=jnp.broadcast_to(labels[:, None], (b, s)),
        completion_mask=mask,
        rewards=jnp.asarray(rewards, jnp.float32),
        old_log_probs=jnp.asarray(trajectory.log_probs, jnp.float32),
        ref_log_probs=ref_log_probs,
        group_size=group_size,
    )


def flow_log_prob_fn(config: SDEConfig) -> LogProbFn:
    """The log-prob hook for ``GRPOTrainer``/``make_grpo_loss`` on flow trajectories.

    ``fn(model, batch)`` recomputes each transition's Gaussian under ``model`` and returns the
    log-density of the stored next state (``(B, S)``) and the transition's entropy
    ``D/2 log(2 pi e std^2)`` (independent of the parameters).

    Args:
        config: The sampler settings (``noise_level > 0``).

    Returns:
        ``fn(model, batch) -> (log_probs, entropy)``.

    Raises:
        ValueError: ``noise_level`` is 0 (the ODE has no density).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import (
        ...     FlowSampler, SDEConfig, flow_log_prob_fn, to_grpo_batch)
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4)
        >>> traj = FlowSampler(sde)(model, [3], 2, jax.random.key(0))
        >>> batch = to_grpo_batch(traj, jnp.array([1.0, 0.0]), group_size=2, config=sde)
        >>> logp, entropy = flow_log_prob_fn(sde)(model, batch)
        >>> logp.shape, bool(jnp.allclose(logp, traj.log_probs, atol=1e-4))  # same as the sampler's
        ((2, 4), True)
    """
    if config.noise_level == 0.0:
        msg = "flow_log_prob_fn needs SDEConfig.noise_level > 0 (the ODE sampler has no density)"
        raise ValueError(msg)

    def fn(model: Any, batch: GRPOBatch) -> tuple[jax.Array, jax.Array]:
        mu, std, x_next = _batch_transitions(model, batch, config)
        d = x_next.shape[-1]
        log_probs = gaussian_log_prob(x_next, mu, std)
        entropy = 0.5 * d * jnp.log(2.0 * math.pi * math.e * std[..., 0] ** 2)
        return log_probs, jnp.broadcast_to(entropy, log_probs.shape)

    return fn


def _batch_transitions(
    model: Any, batch: GRPOBatch, config: SDEConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    states = jnp.asarray(batch.prompt_ids, jnp.float32)
    b, s1, d = states.shape
    s = s1 - 1
    steps = jnp.broadcast_to(jnp.arange(s), (b, s)).reshape(-1)
    x = states[:, :-1].reshape(b * s, d)
    labels = jnp.asarray(batch.completion_ids, jnp.int32).reshape(-1)
    mu, std = sde_step(model, x, labels, steps, config)
    return mu.reshape(b, s, d), std.reshape(b, s, 1), states[:, 1:]


def flow_kl(model: Any, ref_model: Any, batch: GRPOBatch, config: SDEConfig) -> jax.Array:
    r"""Closed-form per-step KL between the policy's and the reference's transitions.

    ``KL_s = ||mu_theta(x_s) - mu_ref(x_s)||^2 / (2 std_s^2)`` at every stored state; the
    two transitions share ``std_s``. Use it as the per-step KL (masked by
    ``completion_mask`` and aggregated like the GRPO loss) or as a metric.

    Args:
        model: The policy.
        ref_model: The reference (gradients are not stopped; wrap it yourself if needed).
        batch: A batch from :func:`to_grpo_batch`.
        config: The sampler settings.

    Returns:
        ``(B, S)`` float32 KL divergences.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.inference import (
        ...     FlowSampler, SDEConfig, flow_kl, to_grpo_batch)
        >>> cfg = FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1, time_features=8)
        >>> model = FlowModel(cfg, rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4)
        >>> batch = to_grpo_batch(FlowSampler(sde)(model, [3], 2, jax.random.key(0)),
        ...                       jnp.array([1.0, 0.0]), group_size=2, config=sde)
        >>> float(flow_kl(model, model, batch, sde).max())  # the same means: no divergence
        0.0
        >>> ref = nnx.clone(model)
        >>> nnx.update(ref, jax.tree.map(lambda p: p + 0.01, nnx.state(ref, nnx.Param)))
        >>> bool((flow_kl(model, ref, batch, sde) > 0).all())
        True
    """
    mu, std, _ = _batch_transitions(model, batch, config)
    mu_ref, _, _ = _batch_transitions(ref_model, batch, config)
    return gaussian_kl(mu, mu_ref, std)
