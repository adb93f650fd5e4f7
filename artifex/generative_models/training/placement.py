"""Roles on their own meshes: the sampler on one set of devices, training on another.

By default the rollout samples with the trainer's own model, on the training mesh. With a
:class:`RolloutPlacement` the sampler runs on a separate mesh (e.g. devices 4-7 sample while
devices 0-3 train): before each rollout the current policy weights are resharded onto the
sampler's mesh with ``jax.device_put`` (a copy laid out by the sampler mesh's own partition
rules: often plain data parallelism or tensor parallelism for decoding, while training uses
FSDP), and the finished generation batch is moved back onto the training mesh, rows over its
data axes. Both directions are device-to-device copies; nothing passes through the host.

This is the layout of disaggregated RL systems (the role-to-mesh mapping of Tunix, Google's JAX
post-training library; the colocated versus separated actor/rollout placement of HybridFlow): it
lets the sampler use a sharding that suits decoding and frees the training devices' memory from the
KV cache. With one process both meshes are sets of local devices (the tests use 8 simulated CPU
devices, 4 and 4). Across processes each mesh should span every process with the same number of
devices per process (e.g. the first half of each host's devices train, the second half sample), so
that every process keeps feeding the same rows to both; that configuration is not tested.

References:
    Sheng et al., 2024, "HybridFlow: A Flexible and Efficient RLHF Framework",
    arXiv:2409.19256 (placing actor and rollout on separate device groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx
from jax.sharding import Mesh

if TYPE_CHECKING:
    from artifex.generative_models.training.sharding import PartitionRules

# The sharding helpers are imported where used: this module is loaded by the package's
# ``__init__`` before ``rl``, and ``sharding`` imports ``rl.batch``.

__all__ = ["RolloutPlacement"]


class RolloutPlacement:
    """The sampler's own mesh, and the weight and batch transfers between it and training.

    Args:
        mesh: The sampler's mesh (e.g. ``make_mesh(devices=jax.devices()[4:])``).
        rules: How the sampler's copy of the weights is laid out on ``mesh``
            (:class:`~artifex.generative_models.training.sharding.PartitionRules` or
            ``(regex, spec)`` pairs); default ``PartitionRules()``.

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: ``mesh`` does not use GSPMD axes (build it with ``make_mesh``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.training.sharding import make_mesh
        >>> from artifex.generative_models.training import RolloutPlacement
        >>> sampler_devices = jax.devices()[-1:]  # the last device samples
        >>> placement = RolloutPlacement(make_mesh(devices=sampler_devices))
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> copy = placement.sampler_model(model)  # the weight sync, before each rollout
        >>> copy.kernel[...].devices() == set(sampler_devices)
        True
        >>> bool(jnp.allclose(copy.kernel[...], model.kernel[...]))
        True
    """

    def __init__(self, mesh: Mesh, rules: PartitionRules | Sequence[tuple[str, Any]] | None = None):
        from artifex.generative_models.training.sharding import check_mesh

        check_mesh(mesh, "RolloutPlacement")
        self.mesh = mesh
        self.rules = rules
        self._shardings: Any = None
        self._graphdef: Any = None

    def sampler_model(self, model: nnx.Module) -> nnx.Module:
        """A copy of ``model`` on the sampler's mesh, with the current weights (the sync).

        Every array of ``model`` (on the training mesh) is copied to its sampler sharding with
        ``jax.device_put``; the layouts are computed once, at the first call. Call it before
        each rollout so the sampler sees the latest update.

        Args:
            model: The policy being trained.

        Returns:
            A new module of the same graph whose arrays live on :attr:`mesh`.
        """
        from artifex.generative_models.training.sharding import state_shardings

        graphdef, state = nnx.split(model)
        if self._shardings is None or self._graphdef != graphdef:
            self._shardings = state_shardings(state, self.mesh, self.rules)
            self._graphdef = graphdef
        moved = jax.tree.map(jax.device_put, state, self._shardings)
        return nnx.merge(graphdef, moved)

    def to_training(self, batch: Any, mesh: Mesh | None) -> Any:
        """Moves a batch made on the sampler's mesh onto the training mesh, rows sharded.

        Args:
            batch: A ``GRPOBatch`` or a pytree of row-major arrays.
            mesh: The training mesh (the trainer's ``mesh``).

        Returns:
            The batch on ``mesh``, rows over its data axes.

        Raises:
            ValueError: ``mesh`` is ``None`` (the trainer needs a mesh to place roles apart).
        """
        from artifex.generative_models.training.sharding import shard_batch

        if mesh is None:
            msg = (
                "RolloutPlacement needs the trainer on a mesh of its own (GRPOTrainer(..., "
                "mesh=...)), got a trainer without a mesh"
            )
            raise ValueError(msg)
        return shard_batch(batch, mesh)
