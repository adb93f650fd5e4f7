r"""The Flow-GRPO SDE: its settings, time grid, Gaussian transitions, log-probs and KL.

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
- (D / 2) log(2 pi)`` for ``D`` pixels. At ``t = 1``, where ``sigma_t`` is infinite, ``1 - t``
is replaced by ``1 - t_1`` (as in the paper's code). With ``a = 0`` the SDE sampler is the Euler
ODE sampler.

The samplers that draw trajectories with these transitions are in
:mod:`~artifex.generative_models.flow.sampling`; the KL of two transitions with the same
variance, ``KL = ||mu_theta - mu_ref||^2 / (2 std^2)`` (:func:`gaussian_kl`), is the exact
KL term of :mod:`~artifex.generative_models.flow.batch`.

References:
    Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv:2505.05470; Li et al., 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with
    Mixed ODE-SDE", arXiv:2507.21802; Xue et al., 2025, "DanceGRPO: Unleashing GRPO on Visual
    Generation", arXiv:2505.07818; Lipman et al., 2022, arXiv:2210.02747; Liu et al., 2022,
    arXiv:2209.03003.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.utils.validation import check_float, check_int

__all__ = [
    "MAX_NOISE_LEVEL",
    "SDEConfig",
    "gaussian_kl",
    "gaussian_log_prob",
    "sde_transition",
    "time_grid",
]

#: Largest noise level ``a``: the Euler-Maruyama mean scales ``x_s`` by ``1 - a^2 / (2 max(s, 1))``
#: (with the ``1 - t_1`` cap at ``s = 0``), which is negative at the first steps for
#: ``a > sqrt(2)``: the discretization overshoots and, for large ``a``, diverges.
MAX_NOISE_LEVEL = math.sqrt(2.0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SDEConfig:
    """Settings of the Flow-GRPO sampler.

    Attributes:
        num_steps: Denoising steps ``S``.
        noise_level: ``a`` in ``sigma_t = a sqrt(t / (1 - t))``, in ``[0, sqrt(2)]``
            (:data:`MAX_NOISE_LEVEL`); 0 gives the Euler ODE sampler.
        window_size: ``W``: only ``W`` consecutive steps per trajectory are SDE steps, the rest
            ODE steps (MixGRPO / Flow-GRPO-Fast); ``None``: every step is an SDE step.
        train_steps: How many of the SDE steps of each trajectory are trained (chosen at
            random per trajectory, as Flow-GRPO trains on a fraction of the timesteps);
            ``None`` trains all of them.

    Raises:
        TypeError: A field of the wrong type.
        ValueError: A field out of range.

    Examples:
        >>> from artifex.generative_models.flow import SDEConfig
        >>> sde = SDEConfig(num_steps=10, noise_level=0.7, window_size=2)
        >>> sde.num_stochastic_steps, sde.num_trained_steps
        (2, 2)
        >>> SDEConfig(num_steps=10, train_steps=4).num_trained_steps
        4
    """

    num_steps: int = 10
    noise_level: float = 0.7
    window_size: int | None = None
    train_steps: int | None = None

    def __post_init__(self) -> None:
        check_int("SDEConfig.num_steps", self.num_steps, minimum=2)
        check_float("SDEConfig.noise_level", self.noise_level, minimum=0.0)
        if self.noise_level > MAX_NOISE_LEVEL:
            msg = (
                f"SDEConfig.noise_level must be in [0, sqrt(2)]: the Euler-Maruyama mean scales "
                f"x_s by 1 - a^2 / 2 at the first steps, negative above sqrt(2), got "
                f"{self.noise_level!r}"
            )
            raise ValueError(msg)
        check_int(
            "SDEConfig.window_size",
            self.window_size,
            minimum=1,
            maximum=self.num_steps,
            allow_none=True,
        )
        check_int(
            "SDEConfig.train_steps",
            self.train_steps,
            minimum=1,
            maximum=self.num_stochastic_steps,
            allow_none=True,
        )

    @property
    def num_stochastic_steps(self) -> int:
        """SDE steps per trajectory: ``window_size``, or ``num_steps`` without a window."""
        return self.num_steps if self.window_size is None else self.window_size

    @property
    def num_trained_steps(self) -> int:
        """Trained steps per trajectory ``K`` (the completion length of the GRPO batch)."""
        return self.num_stochastic_steps if self.train_steps is None else self.train_steps


def time_grid(num_steps: int) -> np.ndarray:
    """The ``S + 1`` times ``t_s = 1 - s / S`` from noise (1) to data (0).

    Args:
        num_steps: ``S``.

    Returns:
        ``(S + 1,)`` float32.

    Examples:
        >>> from artifex.generative_models.flow import time_grid
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
        >>> from artifex.generative_models.flow import sde_transition
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
        >>> from artifex.generative_models.flow import gaussian_log_prob
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
        >>> from artifex.generative_models.flow import gaussian_kl
        >>> gaussian_kl(jnp.array([[1.0, 0.0]]), jnp.zeros((1, 2)), jnp.array([[0.5]])).tolist()
        [2.0]
    """
    diff = jnp.asarray(mean, jnp.float32) - jnp.asarray(ref_mean, jnp.float32)
    std = jnp.asarray(std, jnp.float32)
    return jnp.sum(diff * diff / (2.0 * std * std), axis=-1)
