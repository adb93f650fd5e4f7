"""Where ``artifex-grpo`` runs: devices, hosts, compiled programs and float32 precision.

- the multi-host options (``--coordinator-address``, ``--num-processes``, ``--process-id``,
  ``--distributed``, ``--distributed-timeout``) and the mesh sizes (``--mesh-fsdp``,
  ``--mesh-tensor``): joining the run and building the mesh;
- :func:`enable_compilation_cache`: JAX's persistent compilation cache
  (``--compilation-cache``, default :data:`DEFAULT_COMPILATION_CACHE`);
- :func:`float32_precision_notice`: the note printed when a float32 model's matrix products
  will run below float32 on a GPU (JAX's default precision there).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["float32_precision_notice"]


# ------------------------------------------------------------------------------ multi-host
def _add_distributed_options(parser: argparse.ArgumentParser) -> None:
    """Options of a multi-process (multi-host) run and of the device mesh."""
    from artifex.cli_checks import positive_float, positive_int
    from artifex.generative_models.training.rendezvous import DEFAULT_TIMEOUT_S

    group = parser.add_argument_group(
        "multi-host",
        "Run one `artifex-grpo train` per host (process) with the same arguments. Unset values "
        "come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or, with "
        "--distributed, from JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU).",
    )
    group.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    group.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    group.add_argument("--process-id", type=int, default=None, help="this process's index")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() even with nothing set (auto-detection)",
    )
    group.add_argument(
        "--distributed-timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="how long every process waits for the others to start before it stops with an "
        "error naming the missing ones (default %(default)g)",
    )
    group.add_argument(
        "--mesh-fsdp", type=positive_int, default=1, help="FSDP axis size (default 1)"
    )
    group.add_argument(
        "--mesh-tensor", type=positive_int, default=1, help="tensor axis size (default 1)"
    )


def _setup_devices(args: argparse.Namespace) -> Any:
    """Joins the multi-host run when asked and builds the mesh (``None``: one device)."""
    from artifex.generative_models.training.sharding import initialize_distributed, make_mesh

    if args.coordinator_address is not None and (args.num_processes or 1) > 1:
        print(
            f"artifex-grpo: process {args.process_id} of {args.num_processes}: waiting up to "
            f"{args.distributed_timeout:g} s for every process at {args.coordinator_address} "
            "(--distributed-timeout)",
            file=sys.stderr,
        )
    joined = initialize_distributed(
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        auto=args.distributed,
        timeout=args.distributed_timeout,
    )
    if joined or args.mesh_fsdp > 1 or args.mesh_tensor > 1:
        return make_mesh(fsdp=args.mesh_fsdp, tensor=args.mesh_tensor)
    return None


#: Where the command keeps compiled XLA programs between runs (``--compilation-cache``).
DEFAULT_COMPILATION_CACHE = "~/.cache/artifex/jax"


def enable_compilation_cache(path: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache in ``path``.

    A second run with the same shapes then loads the compiled programs instead of compiling them
    again. Every program is cached, however short its compilation.

    Args:
        path: Cache directory (``~`` expanded, created by JAX). ``"none"`` turns the cache off
            for this process, even where ``JAX_COMPILATION_CACHE_DIR`` would turn it on (JAX
            decides at the process's first compilation, so call this before it). None or ""
            changes nothing.

    Returns:
        The directory used, or None when no cache is turned on here.
    """
    if not path:
        return None
    import jax

    if path.lower() == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return None

    directory = os.path.abspath(os.path.expanduser(path))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


#: Values of ``jax_default_matmul_precision`` that keep float32 matrix products at (or within
#: rounding of) full float32 on a GPU; the others (None, "default", "high", "tensorfloat32",
#: "bfloat16", the lower algorithm presets) use TF32 or less there.
FULL_FLOAT32_PRECISIONS = frozenset(
    ("highest", "float32", "f32_f32_f32", "f64_f64_f64", "tf32_tf32_f32_x3", "bf16_bf16_f32_x6",
     "bf16_bf16_f32_x9")
)  # fmt: skip


def float32_precision_notice(
    model: Any, backend: str | None = None, precision: str | None = None
) -> str | None:
    """A one-line notice when a float32 model's matrix products will run below float32.

    On NVIDIA GPUs JAX's default precision computes float32 matrix products on TF32 tensor
    cores (about 1e-3 relative error), unlike PyTorch's default (`docs/installation.md`). The
    command leaves JAX's setting alone and says so.

    Args:
        model: The loaded model (its `nnx.Param` dtypes are read).
        backend: JAX's backend name; None reads `jax.default_backend()` ("gpu" on NVIDIA and
            AMD GPUs).
        precision: JAX's default matmul precision; None reads
            `jax.config.jax_default_matmul_precision` (which `JAX_DEFAULT_MATMUL_PRECISION`
            sets).

    Returns:
        The notice, or None on a CPU or TPU, at a full-float32 precision
        (`FULL_FLOAT32_PRECISIONS`), or without float32 parameters.

    Examples:
        >>> from flax import nnx
        >>> from artifex.cli import float32_precision_notice
        >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # float32 parameters
        >>> float32_precision_notice(model, "cpu", "default") is None
        True
        >>> float32_precision_notice(model, "gpu", "highest") is None
        True
        >>> float32_precision_notice(model, "gpu", "default").startswith("note: float32")
        True
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    backend = jax.default_backend() if backend is None else backend
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    setting = "default" if precision is None else str(precision)
    if backend not in ("gpu", "cuda", "rocm") or setting.lower() in FULL_FLOAT32_PRECISIONS:
        return None
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    if jnp.dtype(jnp.float32) not in dtypes:
        return None
    return (
        f"note: float32 parameters on a GPU at matmul precision {setting!r}: JAX computes their "
        "matrix products below float32 there (TF32 by default on NVIDIA GPUs, about 1e-3 "
        "relative error); set JAX_DEFAULT_MATMUL_PRECISION=highest for full float32, as "
        "PyTorch computes by default"
    )
