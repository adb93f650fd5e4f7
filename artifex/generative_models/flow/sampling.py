r"""ODE and SDE samplers for flow-matching image models, with exact per-step log-probs.

Each step of the Flow-GRPO SDE (:mod:`~artifex.generative_models.flow.sde`: the
Euler-Maruyama discretization of an SDE with the flow's marginals) is a Gaussian transition
with an exact log-density; with noise level 0 the sampler is the Euler ODE sampler.

**SDE windows** (MixGRPO, Flow-GRPO-Fast): with ``SDEConfig.window_size = W`` only the ``W``
consecutive steps ``[w, w + W)`` of a trajectory are SDE steps (with a log-prob); the others are
Euler ODE steps ``x + v dt`` (deterministic, log-prob 0). Only the window is trained, so the
GRPO update evaluates the model on ``W`` of the ``S`` steps.

A denoising trajectory is a "completion" whose trained steps play the role of tokens in GRPO:
:mod:`~artifex.generative_models.flow.batch` packs trajectories into a
``GRPOBatch`` and provides the log-prob hook and the closed-form KL
``KL = ||mu_theta - mu_ref||^2 / (2 std^2)`` of two transitions with the same variance
(:func:`~artifex.generative_models.flow.sde.gaussian_kl`).

References:
    Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv:2505.05470; Li et al., 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with
    Mixed ODE-SDE", arXiv:2507.21802; Xue et al., 2025, "DanceGRPO: Unleashing GRPO on Visual
    Generation", arXiv:2505.07818; Lipman et al., 2022, arXiv:2210.02747; Liu et al., 2022,
    arXiv:2209.03003.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.flow.sde import (
    SDEConfig,
    gaussian_log_prob,
    sde_transition,
    time_grid,
)
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "FlowSampler",
    "FlowTrajectory",
    "check_prompts",
    "sample_flow",
    "sde_step",
]


def _is_concrete(*xs: Any) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_prompts(model: Any, prompts: Any, rows: int | None = None) -> np.ndarray:
    """Checks prompts against a flow model on the host: integer ids in the model's range.

    Class-conditioned models (``model.config.num_classes``) take ``(B,)`` labels in
    ``[0, num_classes)``; text-conditioned ones (``model.config.vocab_size``) ``(B, L)`` token
    ids in ``[0, vocab_size)``.

    Args:
        model: The flow model.
        prompts: The prompts (array-like).
        rows: The expected number of rows, or ``None``.

    Returns:
        The prompts as an int32 NumPy array.

    Raises:
        TypeError: The prompts are not integers.
        ValueError: Wrong rank or rows, or an id out of the model's range.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig, check_prompts
        >>> model = FlowModel(FlowModelConfig(num_classes=3, hidden_dim=8), rngs=nnx.Rngs(0))
        >>> check_prompts(model, [0, 2]).tolist()
        [0, 2]
        >>> check_prompts(model, [0, 3])
        Traceback (most recent call last):
            ...
        ValueError: prompts must be class labels in [0, 3), got 3 at row 1
    """
    host = np.asarray(prompts)
    if host.dtype == object or not np.issubdtype(host.dtype, np.integer):
        msg = f"prompts must be integer class labels or token ids, got dtype {host.dtype}"
        if host.size and np.issubdtype(host.dtype, np.number):
            msg += f" (first value {host.reshape(-1)[0]!r})"
        raise TypeError(msg)
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    classes = getattr(cfg, "num_classes", None)
    if vocab is not None:
        ndim, what, limit = 2, "token ids", vocab
    else:
        ndim, what, limit = 1, "class labels", classes
    if host.ndim != ndim:
        shape = "(B, L)" if ndim == 2 else "(B,)"
        msg = f"prompts must be {what} of shape {shape}, got shape {host.shape}"
        raise ValueError(msg)
    if rows is not None and host.shape[0] != rows:
        msg = f"prompts must have {rows} rows, got shape {host.shape}"
        raise ValueError(msg)
    if limit is not None and host.size and (host.min() < 0 or host.max() >= limit):
        bad = np.argwhere((host < 0) | (host >= limit))[0]
        msg = f"prompts must be {what} in [0, {limit}), got {host[tuple(bad)]} at row {bad[0]}"
        raise ValueError(msg)
    return host.astype(np.int32)


def _check_noise(noise: Any, config: SDEConfig, data_dim: int | None) -> None:
    shape = tuple(np.shape(noise))
    if (
        len(shape) != 3
        or shape[1] != config.num_steps + 1
        or (data_dim is not None and shape[2] != data_dim)
    ):
        d = "D" if data_dim is None else data_dim
        msg = f"noise must have shape (B, {config.num_steps + 1}, {d}), got {shape}"
        raise ValueError(msg)
    if _is_concrete(noise):
        bad = ~np.isfinite(np.asarray(noise))
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            msg = f"noise must be finite, got {int(bad.sum())} NaN or infinite values (row {row})"
            raise ValueError(msg)


def _window_starts(window_start: Any, b: int, config: SDEConfig) -> jax.Array:
    """``(B,)`` int32 first SDE step of each row (0 without a window)."""
    if config.window_size is None:
        if window_start is not None:
            msg = "window_start is only used with SDEConfig.window_size"
            raise ValueError(msg)
        return jnp.zeros((b,), jnp.int32)
    if window_start is None:
        msg = "sample_flow needs a window_start with SDEConfig.window_size (FlowSampler draws one)"
        raise ValueError(msg)
    last = config.num_steps - config.window_size
    if _is_concrete(window_start):
        host = np.asarray(window_start)
        if not np.issubdtype(host.dtype, np.integer):
            msg = f"window_start must be an int or (B,) ints, got dtype {host.dtype}"
            raise TypeError(msg)
        if host.shape not in ((), (b,)) or host.min() < 0 or host.max() > last:
            msg = (
                f"window_start must be an int or ({b},) ints in [0, {last}] (num_steps - "
                f"window_size), got {host.tolist()}"
            )
            raise ValueError(msg)
    return jnp.broadcast_to(jnp.asarray(window_start, jnp.int32), (b,))


def sde_step(
    model: Any,
    x: jax.Array,
    prompts: jax.Array,
    step: jax.Array,
    config: SDEConfig,
) -> tuple[jax.Array, jax.Array]:
    """Transition mean and std of step ``step`` (from ``t_step`` to ``t_{step+1}``) under ``model``.

    Args:
        model: ``model(x, t, prompts) -> v`` on flattened images.
        x: ``(N, D)`` states at step ``step``.
        prompts: ``(N,)`` class labels or ``(N, L)`` token ids.
        step: ``(N,)`` int step indices in ``[0, S)``.
        config: Sampler settings.

    Returns:
        ``(mu, std)``: ``(N, D)`` means and ``(N, 1)`` standard deviations.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import SDEConfig, sde_step
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> mu, std = sde_step(model, jnp.zeros((2, 16)), jnp.array([3, 7]), jnp.array([0, 1]),
        ...                    SDEConfig(num_steps=4))
        >>> mu.shape, std.shape, bool((std > 0).all())
        ((2, 16), (2, 1), True)
    """
    v, t, t_next = _velocity(model, x, prompts, step, config)
    return sde_transition(x, v, t, t_next, _t_cap(config), config.noise_level)


def _t_cap(config: SDEConfig) -> float:
    return float(time_grid(config.num_steps)[1])


def _velocity(
    model: Any, x: jax.Array, prompts: jax.Array, step: jax.Array, config: SDEConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``v_theta(x, t_step)`` and the times ``t_step``, ``t_{step+1}`` as ``(N, 1)`` columns."""
    grid = jnp.asarray(time_grid(config.num_steps))
    t = grid[step]
    v = jnp.asarray(model(x, t, prompts), jnp.float32)
    return v, t[:, None], grid[step + 1][:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlowTrajectory:
    """Sampled denoising trajectories.

    Attributes:
        states: ``(B, S + 1, D)`` states from noise (index 0) to the image (index ``S``).
        log_probs: ``(B, S)`` log-densities of each transition (0 on ODE steps).
        prompts: ``(B,)`` class labels or ``(B, L)`` token ids.
        stochastic: ``(B, S)`` bool, True on the SDE steps (the window, or every step).
        config: The sampler settings (static metadata).

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> traj = FlowSampler(SDEConfig(num_steps=4))(model, [3], 2, jax.random.key(0))
        >>> traj.states.shape, traj.log_probs.shape, traj.images.shape, traj.prompts.tolist()
        ((2, 5, 16), (2, 4), (2, 16), [3, 3])
    """

    states: jax.Array
    log_probs: jax.Array
    prompts: jax.Array
    stochastic: jax.Array
    config: SDEConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def images(self) -> jax.Array:
        """The final samples ``(B, D)`` (flattened)."""
        return self.states[:, -1]

    @property
    def batch_size(self) -> int:
        """Number of trajectories ``B``."""
        return int(np.shape(self.states)[0])


def sample_flow(
    model: Any,
    prompts: jax.Array,
    noise: jax.Array,
    config: SDEConfig,
    window_start: jax.Array | int | None = None,
) -> FlowTrajectory:
    """Samples trajectories with the SDE (or, at ``noise_level == 0``, the Euler ODE).

    Deterministic given ``noise``: ``noise[:, 0]`` is the starting point ``x_{t=1}``,
    ``noise[:, s + 1]`` the standard normal draw of step ``s`` (unused on ODE steps). With
    ``config.window_size = W``, row ``i`` takes SDE steps ``[w_i, w_i + W)`` and Euler ODE
    steps elsewhere.

    Args:
        model: ``model(x, t, prompts) -> v`` on flattened images.
        prompts: ``(B,)`` class labels or ``(B, L)`` token ids.
        noise: ``(B, S + 1, D)`` standard normal draws.
        config: Sampler settings.
        window_start: With ``window_size``: the first SDE step, an int or ``(B,)`` ints in
            ``[0, S - W]``; otherwise ``None``.

    Returns:
        The :class:`FlowTrajectory`.

    Raises:
        ValueError: ``noise`` has the wrong shape or (checked when concrete) NaN or infinite
            values; prompts out of the model's range; a missing or out-of-range
            ``window_start``.
        TypeError: Prompts or ``window_start`` that are not integers.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import SDEConfig, sample_flow
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> noise = jax.random.normal(jax.random.key(0), (2, 5, 16))  # (B, S + 1, D)
        >>> traj = sample_flow(model, jnp.array([1, 2]), noise, SDEConfig(num_steps=4))
        >>> traj.states.shape, bool(jnp.allclose(traj.states[:, 0], noise[:, 0]))
        ((2, 5, 16), True)
        >>> mixed = sample_flow(model, jnp.array([1, 2]), noise,
        ...                     SDEConfig(num_steps=4, window_size=2), window_start=1)
        >>> mixed.stochastic[0].tolist()  # SDE steps 1 and 2, ODE steps 0 and 3
        [False, True, True, False]
    """
    data_dim = getattr(getattr(model, "config", None), "data_dim", None)
    _check_noise(noise, config, data_dim)
    b = np.shape(noise)[0]
    if _is_concrete(prompts):
        prompts = check_prompts(model, prompts, rows=b)
    prompts = jnp.asarray(prompts, jnp.int32)
    starts = _window_starts(window_start, b, config)
    width = config.num_stochastic_steps
    t_cap = _t_cap(config)
    sde = config.noise_level > 0.0

    def body(x: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple]:
        s, eps = xs
        v, t, t_next = _velocity(model, x, prompts, jnp.full((b,), s), config)
        ode = x + v * (t_next - t)
        if not sde:
            return ode, (ode, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool))
        mu, std = sde_transition(x, v, t, t_next, t_cap, config.noise_level)
        stochastic = (s >= starts) & (s < starts + width)
        x_next = jnp.where(stochastic[:, None], mu + std * eps, ode)
        log_prob = jnp.where(stochastic, gaussian_log_prob(x_next, mu, std), 0.0)
        return x_next, (x_next, log_prob, stochastic)

    x0 = jnp.asarray(noise[:, 0], jnp.float32)
    eps = jnp.moveaxis(jnp.asarray(noise[:, 1:], jnp.float32), 1, 0)
    _, (xs, lps, stoch) = jax.lax.scan(body, x0, (jnp.arange(config.num_steps), eps))
    states = jnp.concatenate([x0[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
    return FlowTrajectory(
        states=states,
        log_probs=jnp.moveaxis(lps, 0, 1),
        prompts=prompts,
        stochastic=jnp.moveaxis(stoch, 0, 1),
        config=config,
    )


class FlowSampler:
    """A compiled :func:`sample_flow` shell: ``K`` images per prompt.

    Rows are prompt-major: row ``i`` belongs to prompt ``i // K``, generation ``i % K``. With
    ``config.window_size`` the window's first step is drawn uniformly from ``[0, S - W]`` for
    the whole batch (Flow-GRPO-Fast) unless ``window_start`` is given (e.g. MixGRPO's sliding
    schedule).

    Args:
        config: Sampler settings.

    Raises:
        TypeError: ``config`` is not an :class:`SDEConfig`.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sampler = FlowSampler(SDEConfig(num_steps=4))
        >>> traj = sampler(model, [3, 5], 4, jax.random.key(0))  # 4 images per class prompt
        >>> traj.prompts.tolist(), sampler.num_compilations
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

    def _sample(
        self,
        graphdef: Any,
        state: nnx.State,
        prompts: jax.Array,
        noise: jax.Array,
        window_start: jax.Array,
    ) -> FlowTrajectory:
        self._num_traces += 1
        window = None if self.config.window_size is None else window_start
        return sample_flow(nnx.merge(graphdef, state), prompts, noise, self.config, window)

    def __call__(
        self,
        model: nnx.Module,
        prompts: Any,
        num_generations: int,
        key: jax.Array,
        *,
        window_start: int | None = None,
    ) -> FlowTrajectory:
        """Samples ``num_generations`` trajectories per prompt.

        Row ``i`` belongs to prompt ``i // K``, generation ``i % K``.

        Args:
            model: The velocity network (``model.config.data_dim`` pixels).
            prompts: ``(P,)`` class labels or ``(P, L)`` token ids.
            num_generations: ``K``.
            key: PRNG key.
            window_start: With ``window_size``: the first SDE step of every row (``None``:
                drawn with ``key``).

        Returns:
            The :class:`FlowTrajectory` of ``P * K`` rows.

        Raises:
            TypeError: Prompts that are not integers, a non-int ``num_generations``.
            ValueError: Prompts out of the model's range, a bad ``window_start``.
        """
        k = check_int("num_generations", num_generations, minimum=1)
        host = check_prompts(model, prompts)
        prompts = jnp.repeat(jnp.asarray(host), k, axis=0)
        b = prompts.shape[0]
        k_noise, k_window = jax.random.split(key)
        cfg = self.config
        if cfg.window_size is None:
            if window_start is not None:
                msg = "window_start is only used with SDEConfig.window_size"
                raise ValueError(msg)
            start = jnp.zeros((b,), jnp.int32)
        elif window_start is None:
            last = cfg.num_steps - cfg.window_size
            start = jnp.full((b,), jax.random.randint(k_window, (), 0, last + 1), jnp.int32)
        else:
            start = _window_starts(check_int("window_start", window_start), b, cfg)
        d = model.config.data_dim
        noise = jax.random.normal(k_noise, (b, cfg.num_steps + 1, d))
        graphdef, state = nnx.split(model)
        return self._fn(graphdef, state, prompts, noise, start)
