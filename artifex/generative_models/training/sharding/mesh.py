"""The mesh: ``make_mesh``, the axis names, the mesh in scope.

Part of the package :mod:`artifex.generative_models.training.sharding`, which re-exports
every public name (see its docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from artifex.generative_models.utils.validation import check_int

__all__ = [
    "DATA_AXES",
    "MESH_AXES",
    "current_mesh",
    "make_mesh",
]

#: Names of the mesh axes, outermost first.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
#: The axes a batch is split over (its rows), together (those the mesh has; ``"expert"`` only
#: on a mesh made with ``make_mesh(expert=n)``, where it is data parallel outside the experts).
DATA_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


def make_mesh(
    data: int | None = None,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    expert: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a ``Mesh`` with axes ``("data", "fsdp", "tensor")`` over the given devices.

    With ``expert`` the axes are ``("data", "fsdp", "expert", "tensor")``: the experts of
    mixture-of-experts layers are split over ``"expert"`` (see :data:`MOE_RULES`) and the
    batch's rows over ``"data"``, ``"fsdp"`` and ``"expert"`` (outside the experts,
    ``"expert"`` is one more data-parallel axis).

    ``data * fsdp * tensor`` (times ``expert``) must equal the number of devices. The axes are
    of type ``AxisType.Auto`` (GSPMD propagation; ``jax.make_mesh`` otherwise defaults to explicit
    sharding, which the model code is not written for). Device order follows
    ``jax.make_mesh`` (topology-aware on TPU/GPU; by process, so each process's devices form
    contiguous data shards).

    Args:
        data: Size of the pure data-parallel axis; ``None`` uses all devices left over by
            ``fsdp * tensor`` (by default every device is on ``"data"``).
        fsdp: Size of the FSDP axis (parameters and optimizer state split ``1/fsdp``; the batch
            is split over it as well).
        tensor: Size of the tensor-parallel axis (Megatron-style).
        expert: Size of the expert-parallel axis, or ``None`` for a mesh without one.
        devices: Devices to use (default: ``jax.devices()``, all processes' devices).

    Returns:
        The mesh.

    Raises:
        ValueError: An axis size is not a positive int, or the product of the sizes is not
            the number of devices.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import make_mesh
        >>> mesh = make_mesh(devices=jax.devices()[:1])  # every device on "data"
        >>> dict(mesh.shape)
        {'data': 1, 'fsdp': 1, 'tensor': 1}
        >>> dict(make_mesh(data=2, fsdp=2, devices=jax.devices()[:4]).shape)  # needs 4 devices
        {'data': 2, 'fsdp': 2, 'tensor': 1}
        >>> dict(make_mesh(data=1, expert=2, devices=jax.devices()[:2]).shape)  # 2 devices
        {'data': 1, 'fsdp': 1, 'expert': 2, 'tensor': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in (("fsdp", fsdp), ("tensor", tensor), ("data", data), ("expert", expert)):
        if size is None:
            continue
        check_int(f"make_mesh: {name}", size, minimum=1)
    ep = 1 if expert is None else int(expert)
    if data is None:
        if n % (fsdp * tensor * ep):
            msg = (
                f"make_mesh: fsdp * tensor = {fsdp} * {tensor} = {fsdp * tensor} does not divide "
                f"the {n} devices"
            )
            if expert is not None:
                msg = (
                    f"make_mesh: fsdp * expert * tensor = {fsdp} * {ep} * {tensor} = "
                    f"{fsdp * ep * tensor} does not divide the {n} devices"
                )
            raise ValueError(msg)
        data = n // (fsdp * tensor * ep)
    if data * fsdp * tensor * ep != n:
        msg = (
            f"make_mesh: data * fsdp * tensor = {data} * {fsdp} * {tensor} = "
            f"{data * fsdp * tensor} must equal the number of devices, {n}"
        )
        if expert is not None:
            msg = (
                f"make_mesh: data * fsdp * expert * tensor = {data} * {fsdp} * {ep} * {tensor} = "
                f"{data * fsdp * ep * tensor} must equal the number of devices, {n}"
            )
        raise ValueError(msg)
    if expert is not None:
        shape = (int(data), int(fsdp), ep, int(tensor))
        axes = ("data", "fsdp", "expert", "tensor")
        return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * 4, devices=devices)
    shape = (int(data), int(fsdp), int(tensor))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def current_mesh() -> Mesh | None:
    """The concrete mesh set with ``jax.set_mesh(mesh)`` (as a context or globally), if any.

    Returns:
        The mesh, or ``None`` when no mesh is set.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import current_mesh, make_mesh
        >>> mesh = make_mesh(devices=jax.devices()[:1])
        >>> current_mesh() is None
        True
        >>> with jax.set_mesh(mesh):
        ...     current_mesh() is mesh
        True
    """
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def check_mesh(mesh: Any, where: str) -> None:
    """Raises unless ``mesh`` is a ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto``.

    ``where`` names the caller in the message (the model code relies on GSPMD propagation).
    """
    if not isinstance(mesh, Mesh):
        msg = f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        raise TypeError(msg)
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
        if kind != AxisType.Auto:
            msg = (
                f"{where}: mesh axis {name!r} is {kind}, but the model code relies on GSPMD "
                "propagation (AxisType.Auto); build the mesh with make_mesh(...) or "
                "jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)"
            )
            raise ValueError(msg)
