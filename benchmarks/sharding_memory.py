"""Per-device memory of the compiled GRPO step under FSDP: ``python benchmarks/sharding_memory.py``.

Compiles (does not run) ``GRPOTrainer``'s step for a ~26M-parameter Qwen2-shaped model (vocab
16384, width 512, 6 layers, 8 query / 2 kv heads, MLP 1536, tied embeddings, q/k/v biases,
fp32) with AdamW, on meshes ``(data=1, fsdp=n, tensor=1)`` over the first ``n`` of 8 simulated
CPU devices, ``n = 1, 2, 4, 8``. XLA's ``memory_analysis()`` of the per-device program gives the
argument bytes (parameters + optimizer state + batch); the parameter plus optimizer bytes held
by one device are also summed from the arrays' shards. With FSDP both shrink to about ``1/n``
(norms and biases, under ``fsdp_min_size`` elements, stay replicated). Prints Markdown rows
``| benchmark | value | detail |``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from artifex.generative_models.models.causal_lm import CausalLM  # noqa: E402
from artifex.generative_models.training import GRPOConfig, GRPOTrainer, make_mesh  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.workloads import Q26M, Workload, random_batch  # noqa: E402

MIB = 2**20

#: ~26M parameters, Qwen2-shaped.
# The ~26M-parameter policy of benchmarks/workloads.py, with a small batch and no reference.
S26M = dataclasses.replace(
    Q26M, name="S26M", num_prompts=4, num_generations=2, completion_length=32, beta=0.0
)


def _device_bytes(tree: object, device: jax.Device) -> int:
    """Bytes of the shards of ``tree``'s arrays that live on ``device``."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total


def fsdp_memory(n: int, w: Workload = S26M) -> dict[str, float]:
    """Compiles the step on a ``(1, n, 1)`` mesh and returns its per-device memory (bytes).

    Args:
        n: FSDP degree (devices used).
        w: The workload.

    Returns:
        ``argument_bytes``, ``temp_bytes``, ``output_bytes`` and ``alias_bytes`` from XLA's
        memory analysis, plus ``state_bytes`` (parameters + optimizer state on the first device)
        and ``batch_bytes`` (the batch on the first device).
    """
    devices = jax.devices()[:n]
    mesh = make_mesh(data=1, fsdp=n, devices=devices)
    model = CausalLM(w.model, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)
    config = GRPOConfig(num_generations=w.num_generations, beta=w.beta)
    trainer = GRPOTrainer(model, optimizer, config, mesh=mesh)
    batch = trainer.prepare_batch(random_batch(w))
    state = trainer.state
    mem = common.compiled_memory(trainer.compiled_step(), state, batch)
    mem["state_bytes"] = float(_device_bytes(state, devices[0]))
    mem["batch_bytes"] = float(_device_bytes(batch, devices[0]))
    return mem


def main() -> None:
    """Prints the table rows."""
    params = S26M.model.num_params()
    print("| benchmark | value | detail |")
    print("|---|---|---|")
    base = None
    for n in (1, 2, 4, 8):
        mem = fsdp_memory(n)
        base = mem if base is None else base
        arg_ratio = base["argument_bytes"] / mem["argument_bytes"]
        state_ratio = base["state_bytes"] / mem["state_bytes"]
        print(
            f"| FSDP step memory, n={n} | {mem['argument_bytes'] / MIB:.1f} MiB arguments/device "
            f"| params+AdamW state on one device {mem['state_bytes'] / MIB:.1f} MiB "
            f"(1/{state_ratio:.2f} of n=1), arguments 1/{arg_ratio:.2f} of n=1 "
            f"(batch {mem['batch_bytes'] / 1024:.1f} KiB), temp {mem['temp_bytes'] / MIB:.1f} MiB; "
            f"{params / 1e6:.1f}M-param Qwen2-shaped fp32, mesh (1, {n}, 1), compile only |"
        )


if __name__ == "__main__":
    main()
