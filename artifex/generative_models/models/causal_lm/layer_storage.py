"""How `CausalLM` stores its decoder layers: one module per layer, or stacked on a layer axis.

`LayerStack` is the layers as one layer's graph and their states stacked on a new axis 0, what
`jax.lax.scan` runs over. `LayerStorage`, a base of `CausalLM`, holds the methods that build
it (`layer_stack`) and that change the model's storage in place (`stack_layers`,
`unstack_layers`).

Moved out of :mod:`~artifex.generative_models.models.causal_lm.model` unchanged; it still
imports `LayerStack`, so it stays importable from there.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

__all__ = ["LayerStack", "LayerStorage"]


class LayerStack(NamedTuple):
    """Decoder layers ready for `jax.lax.scan`: one layer's graph and the stacked states.

    Attributes:
        graphdef: The static structure shared by every layer.
        state: The layers' states, each leaf stacked to `(num_layers, ...)`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> stack = model.layer_stack()  # made once, e.g. outside a decode loop
        >>> ids = jnp.array([[1, 2, 3]])
        >>> scanned, _ = model.hidden_states(ids, layer_stack=stack)
        >>> unrolled, _ = model.hidden_states(ids)  # model.scan_layers is False
        >>> bool(jnp.allclose(scanned, unrolled, atol=1e-5))
        True
    """

    graphdef: nnx.GraphDef
    state: nnx.State


class LayerStorage:
    """The decoder-layer storage methods of `CausalLM` (a base class of it).

    `layer_stack()` gives the layers as a `LayerStack`; `stack_layers()` and `unstack_layers()`
    store them stacked or one module per layer (attribute `layers_stacked`). The methods read
    the model's `config` and `layers`.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.layer_storage import LayerStorage
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> isinstance(model, LayerStorage), model.stack_layers().layers_stacked
        (True, True)
    """

    def _layer_states(self) -> list[tuple[nnx.GraphDef, nnx.State]]:
        """Each decoder layer's `(graphdef, state)`; stacked layers are split along axis 0.

        Splitting stacked layers slices their weights (a copy inside a traced function), and
        the gradient of the slices is their concatenation (`lax.split`), one copy back.
        """
        if not getattr(self, "layers_stacked", False):
            return [nnx.split(layer) for layer in self.layers]
        graphdef, stacked = nnx.split(self.layers)
        n = self.config.num_layers
        leaves, treedef = jax.tree.flatten(stacked)
        parts = [jax.lax.split(x, [1] * n, axis=0) for x in leaves]
        return [
            (graphdef, jax.tree.unflatten(treedef, [jnp.squeeze(p[i], 0) for p in parts]))
            for i in range(n)
        ]

    def layer_stack(self) -> LayerStack | None:
        """The decoder layers as one layer's graph and their states stacked on a new axis 0.

        With stacked layers (`stack_layers()`) this is the model's own storage, no copy.
        Otherwise every layer must have the same structure (the same variables, shapes and
        dtypes, LoRA adapters included), or there is nothing to scan over and None is returned
        (the layers then run unrolled); inside a traced function the stack is then a copy of
        the layer weights that a gradient flows through back to each layer's own variables.

        Returns:
            A `LayerStack` `(graphdef, state)` with every leaf of shape `(num_layers, ...)`, or
            None if the layers differ in structure.

        Examples:
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> stack = model.layer_stack()
            >>> stack.state["mlp"]["up_proj"]["kernel"].shape  # (L, D, F)
            (2, 128, 384)
        """
        if getattr(self, "layers_stacked", False):
            return LayerStack(*nnx.split(self.layers))
        graphdef = None
        states = []
        for layer in self.layers:
            layer_graph, state = nnx.split(layer)
            if graphdef is None:
                graphdef = layer_graph
            elif layer_graph != graphdef:
                return None
            states.append(state)
        if graphdef is None:
            return None
        shapes = {tuple((x.shape, x.dtype) for x in jax.tree.leaves(st)) for st in states}
        if len(shapes) != 1:
            return None
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        return LayerStack(graphdef, stacked)

    def stack_layers(self) -> Self:
        """Stores the decoder layers stacked, in place: one variable per kind, layer on axis 0.

        The values and the function are the same; the parameter paths become
        `layers.<name>` with a leading layer axis (see the module docstring). Scanned layers
        (`scan_layers`, `GRPOConfig.scan_layers`) then read this storage directly instead of
        stacking a copy of the weights in every traced call, and an optimizer has one array
        per weight kind instead of one per layer and kind, so the GRPO update compiles faster
        and needs less memory (docs/benchmarks.md).

        Build the optimizer after this call: one built before holds the per-layer arrays
        (`GRPOTrainer` refuses such a pair). A variable's sharding annotation, if any, gets a
        leading `None` (the layer axis is not sharded), and each stacked variable carries the
        metadata `stacked_layers=True`, which `state_partition_specs` (and so `shard_model`)
        reads from the model or its `nnx.State` to shard the stack as it shards one layer; a
        plain dict of arrays has no metadata, and `PartitionRules.spec` alone sees a stack as
        one array. Unrolled layers (the sampler's decoding unless `scan_layers`,
        `remat_every > 1`) slice the stack once per call: a copy of the layer weights while the
        call runs. Checkpoints hold the
        layout they were written from: restore into a model of the same layout.

        Returns:
            The model itself (stacked; a no-op when it already is).

        Raises:
            ValueError: If the layers differ in structure (variables, shapes or dtypes), or
                the model is abstract (`nnx.eval_shape`).

        Examples:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> ids = jnp.array([[1, 2, 3]])
            >>> before = model(ids)
            >>> model = model.stack_layers()
            >>> model.layers.mlp.up_proj.kernel.shape  # (L, D, F)
            (2, 128, 384)
            >>> bool(jnp.allclose(model(ids), before, atol=1e-5))
            True
        """
        if self.layers_stacked:
            return self
        _check_concrete(self.layers, "stack_layers")
        stack = self.layer_stack()
        if stack is None:
            msg = (
                "stack_layers: the decoder layers differ in structure (variables, shapes or "
                "dtypes), so they cannot be stacked"
            )
            raise ValueError(msg)
        layers = nnx.merge(stack.graphdef, stack.state)
        for _, var in nnx.iter_graph(layers):
            if isinstance(var, nnx.Variable):
                _mark_stacked(var, True)
        self.layers = layers
        self.layers_stacked = True
        return self

    def unstack_layers(self) -> Self:
        """Stores the decoder layers one module per layer again (undoes `stack_layers`).

        Returns:
            The model itself (per-layer; a no-op when it already is).

        Raises:
            ValueError: If the model is abstract (`nnx.eval_shape`).

        Examples:
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> kernel = model.layers[1].attn.q_proj.kernel[...]
            >>> model = model.stack_layers().unstack_layers()
            >>> bool((model.layers[1].attn.q_proj.kernel[...] == kernel).all())
            True
        """
        if not self.layers_stacked:
            return self
        _check_concrete(self.layers, "unstack_layers")
        layers = []
        for graphdef, state in self._layer_states():
            layer = nnx.merge(graphdef, state)
            for _, var in nnx.iter_graph(layer):
                if isinstance(var, nnx.Variable):
                    _mark_stacked(var, False)
            layers.append(layer)
        self.layers = nnx.List(layers)
        self.layers_stacked = False
        return self


def _check_concrete(layers: Any, where: str) -> None:
    """Raises ValueError for an abstract model (`nnx.eval_shape`): nothing to stack or slice."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(layers))):
        msg = (
            f"{where}: the model is abstract (built by nnx.eval_shape, its variables hold "
            "shapes only); call it on a model with weights, or inside the function given to "
            "nnx.eval_shape"
        )
        raise ValueError(msg)


def _mark_stacked(var: nnx.Variable, stacked: bool) -> None:
    """Sets (or clears) a variable's `stacked_layers` metadata; a leading None on its annotation."""
    sharding = var.get_metadata().get("out_sharding")
    if sharding:
        entries = (None, *sharding) if stacked else tuple(sharding)[1:]
        # the annotation keeps its type (a PartitionSpec stays one, a tuple a tuple)
        var.set_metadata(
            out_sharding=type(sharding)(*entries)
            if isinstance(sharding, PartitionSpec)
            else entries
        )
    if stacked:
        var.set_metadata(stacked_layers=True)
    elif var.has_metadata("stacked_layers"):
        var.del_metadata("stacked_layers")
