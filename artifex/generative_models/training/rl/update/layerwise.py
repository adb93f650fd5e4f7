"""The GRPO update of a causal LM as small compiled programs, run layer by layer.

``GRPOConfig(layerwise_update=True)`` makes :class:`~artifex.generative_models.training.GRPOTrainer`
run its update as a sequence of small programs called from Python instead of one program:

1. the layers' inputs (token ids, RoPE tables, attention mask) and the embedding;
2. the reference's log-probs: its layers one by one, then its output projection;
3. the policy's layers one by one, keeping each layer's input;
4. the output projection, the log-probs and the objective, with their gradient;
5. each layer's backward pass, last to first, recomputing the layer from its input;
6. the embedding's gradient (added to the output projection's for a tied embedding);
7. clipping, ``tx`` and the guard, one decoder layer at a time where ``tx`` allows it
   (:class:`~artifex.generative_models.training.rl.update.optimizer_split.LayerOptimizer`), else in
   one program (:func:`~artifex.generative_models.training.rl.update.state.apply_gradients`); these
   programs donate the state's input buffers to XLA (reuse them for their outputs).

Every decoder layer of one structure runs the same compiled program, so the compile time of the
layers' programs does not grow with the depth, where the one-program update holds every layer
unrolled and XLA:CPU's compile time grows faster than linearly with its size; the optimizer's
per-layer programs likewise replace one program holding the work of every parameter array. The
values are those of the one-program update with ``remat=True``; each update is a little slower,
as XLA cannot fuse or overlap work across the programs.

No buffer is donated before the optimizer's update programs, which run only after every
group's new state was checked: a failure before them leaves the state as it was, and the guard
rejects a non-finite update as the one-program step does.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from artifex.generative_models.training.rl.core import losses
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import chunked_token_log_probs
from artifex.generative_models.training.rl.core.objective import (
    batch_reward_metrics,
    compute_advantages,
    grpo_objective,
)
from artifex.generative_models.training.rl.update.compile_ahead import MultiProgramEngine
from artifex.generative_models.training.rl.update.optimizer_split import (
    LayerOptimizer,
    LayerSplit,
    SplitDecisions,
    group_tree,
    lower_programs,
)
from artifex.generative_models.training.rl.update.state import (
    GRPOTrainState,
    advantage_signal,
    apply_gradients,
)
from artifex.generative_models.utils.compile_options import jit

__all__ = ["LayerwiseStep", "check_layerwise_model"]

_HEAD_MODULES = ("embed", "final_norm", "lm_head")


def check_layerwise_model(model: Any, reference_model: Any, wrt: Any = nnx.Param) -> None:
    """Raises unless ``model`` (and ``reference_model``) can run the layer-by-layer update.

    Args:
        model: The policy.
        reference_model: The reference policy, or None.
        wrt: The filter of the policy's trainable variables.

    Raises:
        TypeError: The model is not a causal LM with per-layer storage (``CausalLM``), or the
            reference is not one of the same kind.
        ValueError: The layers are stored stacked (``stack_layers()``), or a trainable
            variable lies outside the embedding, the layers, the final norm and the output
            projection.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl.update.layerwise import check_layerwise_model
        >>> try:
        ...     check_layerwise_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), None)
        ... except TypeError as err:
        ...     print(str(err)[:60])
        GRPOConfig.layerwise_update needs a CausalLM model (layer_in
    """
    for name, m in (("model", model), ("reference_model", reference_model)):
        if m is None and name == "reference_model":
            continue
        needed = ("layer_inputs", "embed", "layers", "final_norm")
        if not all(hasattr(m, a) for a in needed):
            msg = (
                f"GRPOConfig.layerwise_update needs a CausalLM {name} (layer_inputs, embed, "
                f"layers, final_norm), got {type(m).__name__}"
            )
            raise TypeError(msg)
        if getattr(m, "layers_stacked", False):
            msg = (
                f"GRPOConfig.layerwise_update runs the layers one by one from their own arrays; "
                f"the {name}'s layers are stored stacked: call unstack_layers() first"
            )
            raise ValueError(msg)
        cfg = getattr(m, "config", None)
        if len(set(getattr(cfg, "sliding_layers", ()))) > 1 or getattr(
            cfg, "final_logit_softcapping", None
        ):
            msg = (
                f"GRPOConfig.layerwise_update gives every layer the same inputs and projects "
                f"plain logits; the {name} ({cfg.model_type}) mixes sliding-window and global "
                "layers or soft-caps its logits: use the one-program update "
                "(layerwise_update=False)"
            )
            raise ValueError(msg)
    outside = sorted(
        {path[0] for path, _ in nnx.to_flat_state(nnx.state(model, wrt))}
        - {"layers", *_HEAD_MODULES}
    )
    if outside:
        msg = (
            "GRPOConfig.layerwise_update differentiates the embedding, the decoder layers, the "
            f"final norm and the output projection only; the model has trainable {outside}"
        )
        raise ValueError(msg)


def _sub(tree: Any, *path: Any) -> Any:
    """The sub-state of ``tree`` at ``path`` (an empty state where there is none)."""
    for key in path:
        if tree is None or key not in tree:
            return nnx.State({})
        tree = tree[key]
    return tree


def _prefixed(tree: Any, prefix: tuple) -> dict[tuple, Any]:
    return {
        prefix + tuple(_key(k) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _key(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _assemble(params: Any, pieces: dict[tuple, Any]) -> Any:
    """The gradient tree shaped like ``params`` from each module's gradient (by leaf path)."""
    flat: dict[tuple, Any] = {}
    for prefix, tree in pieces.items():
        flat.update(_prefixed(tree, prefix))
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = [tuple(_key(k) for k in path) for path, _ in paths]
    missing = [k for k in keys if k not in flat]
    if missing:  # a trainable variable outside the embedding, layers, norm and head
        msg = f"the layer-by-layer update has no gradient for the parameters at {missing[:3]}"
        raise ValueError(msg)
    return jax.tree.unflatten(treedef, [flat[k] for k in keys])


def _used(tied: bool) -> tuple[str, ...]:
    """The modules the output projection reads: the embedding when tied, else ``lm_head``."""
    return ("embed", "final_norm") if tied else _HEAD_MODULES


def _merge(graph: Any, params: Any, frozen: Any, zero_params: bool) -> Any:
    if zero_params:  # a LoRA policy's reference: the same model with its adapters zeroed
        params = jax.tree.map(jnp.zeros_like, params)
    return nnx.merge(graph, params, frozen)


class LayerwiseStep(MultiProgramEngine):
    """A trainer's update run as per-layer programs: a step engine (``StepEngine``).

    ``step(state, batch) -> (state, metrics)`` computes what ``jax.jit(grpo_train_step)``
    computes for a causal LM with ``remat=True``; the buffers of the parameters, optimizer
    state and step are donated to XLA (reused for the outputs) by the optimizer's last programs
    only.

    Args:
        model: The policy (a ``CausalLM`` with per-layer storage).
        tx: The optax gradient transformation.
        config: The GRPO options.
        wrt: The trainable variables' filter.
        reference_model: The reference policy, or None.
        lora_reference: Without a reference model, use the policy with zeroed LoRA adapters.
        on_trace: Called each time the update is traced for a new batch structure.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training import GRPOConfig, GRPOTrainer
        >>> from artifex.generative_models.training.rl import GRPOBatch
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> config = GRPOConfig(num_generations=2, beta=0.0, remat=True, layerwise_update=True)
        >>> trainer = GRPOTrainer(model, optimizer, config)
        >>> type(trainer.compiled_step()).__name__
        'LayerwiseStep'
        >>> batch = GRPOBatch.zeros(1, 2, 4, 3).replace(rewards=jnp.array([1.0, 0.0]))
        >>> metrics = trainer.train_step(batch)
        >>> int(optimizer.step[...]), trainer.num_compilations
        (1, 1)
    """

    _ONE_PROGRAM = "GRPOConfig(layerwise_update=False)"

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        config: GRPOConfig,
        *,
        wrt: Any,
        reference_model: nnx.Module | None,
        lora_reference: bool,
        on_trace: Callable[[], None],
    ):
        check_layerwise_model(model, reference_model, wrt)
        self._model = model  # read for its config and dtype only (layer_inputs)
        self._config = config
        self._tx = tx
        self._lora_reference = lora_reference
        self._on_trace = on_trace
        super().__init__()  # compile_ahead's per-program futures
        self._decisions = SplitDecisions(tx)  # split_by_layer, by the state's types
        #: Why the optimizer runs as one program (empty while it runs layer by layer).
        self.optimizer_split_reason = ""

        def graph(module: Any, filters: tuple) -> Any:
            return None if module is None else nnx.split(module, *filters)[0]

        policy_filters = (wrt, ...)
        self._graphs = {name: graph(getattr(model, name), policy_filters) for name in _HEAD_MODULES}
        self._layer_graphs = [graph(layer, policy_filters) for layer in model.layers]
        ref = reference_model
        self._ref_graphs = (
            None if ref is None else {n: graph(getattr(ref, n), (...,)) for n in _HEAD_MODULES}
        )
        self._ref_layer_graphs = (
            None if ref is None else [graph(layer, (...,)) for layer in ref.layers]
        )
        self._tied = model.lm_head is None
        self._ref_tied = None if ref is None else ref.lm_head is None
        self._reference = ref
        self._programs()

    # ------------------------------------------------------------------ the programs
    def _programs(self) -> None:
        config, model, ref = self._config, self._model, self._reference

        def layer_inputs(m: Any, batch: GRPOBatch) -> tuple:
            g = batch.group_size if batch.shared_prompts else None
            step = g or 1
            return m.layer_inputs(
                batch.prompt_ids[::step],
                batch.completion_ids,
                batch.prompt_mask[::step],
                group=g,
            )

        def inputs(batch: GRPOBatch) -> tuple:
            self._on_trace()
            return layer_inputs(model, batch)

        def embed(graph, params, frozen, ids, zero_params, dtype):
            return _merge(graph, params, frozen, zero_params)(ids).astype(dtype)

        def layer(graph, params, frozen, h, cos, sin, mask, zero_params=False):
            module = _merge(graph, params, frozen, zero_params)
            return module(h, cos, sin, mask, None, None)[0]

        def layer_backward(graph, params, frozen, h, cos, sin, mask, dh):
            def f(p, x):
                return layer(graph, p, frozen, x, cos, sin, mask)

            _, vjp = jax.vjp(f, params, h)
            return vjp(dh)

        def embed_backward(graph, params, frozen, ids, dh):
            _, vjp = jax.vjp(lambda p: embed(graph, p, frozen, ids, False, model.dtype), params)
            return vjp(dh)[0]

        def log_probs(graphs, states, h, batch, zero_params=False):
            graphs = dict(graphs)
            tied = "lm_head" not in graphs  # the policy's, or the reference's own
            norm = _merge(graphs["final_norm"], *states["final_norm"], zero_params)
            hidden = norm(h)
            rows, t = batch.completion_ids.shape
            if batch.shared_prompts:  # [prompt ; completion 1 ; ... ; completion G] per row
                g = batch.group_size
                p = hidden.shape[1] - g * t
                first = jnp.repeat(hidden[:, p - 1 : p], g, axis=0)
                completions = hidden[:, p:].reshape(rows, t, hidden.shape[-1])
                hidden = jnp.concatenate([first, completions[:, :-1]], axis=1)
            else:
                p = batch.prompt_ids.shape[1]
                hidden = hidden[:, p - 1 : p + t - 1]
            if tied:  # the embedding as stored, (V, D)
                weight = _merge(graphs["embed"], *states["embed"], zero_params).embedding[...]
            else:
                weight = _merge(graphs["lm_head"], *states["lm_head"], zero_params).kernel[...]
            if config.temperature != 1.0:
                hidden = hidden / jnp.asarray(config.temperature, hidden.dtype)
            return chunked_token_log_probs(hidden, weight, batch.completion_ids, transposed=tied)

        def reference_log_probs(graphs, states, h, batch, zero_params):
            return jax.lax.stop_gradient(log_probs(graphs, states, h, batch, zero_params)[0])

        def head(graphs, params, frozen, h, batch):
            precomputed = batch.advantages is not None
            advantages = jax.lax.stop_gradient(compute_advantages(batch, config))
            normalizer = losses.loss_normalizer(
                batch.completion_mask,
                config.loss_aggregation,
                max_length=config.max_completion_length,
            )

            def objective(p, x):
                states = {n: (p[n], frozen[n]) for n in p}
                lp, entropy = log_probs(graphs, states, x, batch)
                return grpo_objective(
                    lp,
                    entropy,
                    batch,
                    config,
                    normalizer=normalizer,
                    advantages=advantages,
                    reward_metrics=False,
                )

            grad = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)
            (loss, metrics), (d_params, dh) = grad(params, h)
            if not precomputed:
                metrics.update(batch_reward_metrics(batch, advantages))
            metrics["advantage_signal"] = advantage_signal(advantages, batch.completion_mask)
            return loss, metrics, d_params, dh

        def finish(params, opt_state, step, pieces, loss, metrics, batch):
            if self._tied:  # the embedding's two uses: lookup and output projection
                pieces = dict(pieces)
                pieces[("embed",)] = jax.tree.map(
                    jnp.add, pieces[("embed",)], pieces.pop(("embed", "head"))
                )
            grads = _assemble(params, pieces)
            state = GRPOTrainState(params, None, opt_state, step, None, None)
            new, metrics = apply_gradients(self._tx, config, state, batch, loss, metrics, grads)
            return (new.params, new.opt_state, new.step), metrics

        # The optimizer group by group (a decoder layer, then the rest), where
        # `split_by_layer` has found that the same as the whole (AdamW, SGD, ...): its programs
        # compile once per group structure, not once for all 273 arrays of SmolLM2-135M.
        self._optimizer = LayerOptimizer(self._tx, config)
        self._add = jit(partial(jax.tree.map, jnp.add))

        self._inputs = jit(inputs)
        # A reference of another configuration or dtype (RoPE, head size) has its own inputs.
        same = ref is None or (ref.config == model.config and ref.dtype == model.dtype)
        self._reference_inputs = self._inputs if same else jit(partial(layer_inputs, ref))
        self._embed = jit(embed, static_argnums=(0, 4, 5))
        self._layer = jit(layer, static_argnums=(0, 7))
        self._layer_backward = jit(layer_backward, static_argnums=0, donate_argnums=7)
        self._embed_backward = jit(embed_backward, static_argnums=0)
        self._reference_log_probs = jit(reference_log_probs, static_argnums=(0, 4))
        self._head = jit(head, static_argnums=0)
        self._finish = jit(finish, donate_argnums=(0, 1, 2))

    # ------------------------------------------------------------------ one update
    def _needs_reference(self, state: GRPOTrainState, batch: GRPOBatch) -> bool:
        has_ref = (state.reference is not None and self._ref_graphs is not None) or (
            self._lora_reference
        )
        return self._config.beta > 0.0 and batch.ref_log_probs is None and has_ref

    def _run(self, state: GRPOTrainState, batch: GRPOBatch, fn: dict[str, Any]) -> Any:
        """One update through the program callables ``fn`` (jitted, or lowering ones)."""
        params, frozen = state.params, state.frozen
        ids, cos, sin, mask = fn["inputs"](batch)

        if self._needs_reference(state, batch):
            if state.reference is not None and self._ref_graphs is not None:
                graphs, layer_graphs, zero = self._ref_graphs, self._ref_layer_graphs, False
                ref, ref_other = state.reference, nnx.State({})
                used, dtype = _used(self._ref_tied), self._reference.dtype
                ref_ids, ref_cos, ref_sin, ref_mask = fn["reference_inputs"](batch)
            else:  # the policy with zeroed adapters
                graphs, layer_graphs, zero = self._graphs, self._layer_graphs, True
                ref, ref_other = params, frozen
                used, dtype = _used(self._tied), self._model.dtype
                ref_ids, ref_cos, ref_sin, ref_mask = ids, cos, sin, mask
            ref_embed, ref_embed_other = _sub(ref, "embed"), _sub(ref_other, "embed")
            h = fn["embed"](graphs["embed"], ref_embed, ref_embed_other, ref_ids, zero, dtype)
            for i, lg in enumerate(layer_graphs):
                layer_ref, layer_other = _sub(ref, "layers", i), _sub(ref_other, "layers", i)
                h = fn["layer"](lg, layer_ref, layer_other, h, ref_cos, ref_sin, ref_mask, zero)
            ref_graphs = tuple((n, graphs[n]) for n in used)
            ref_states = {n: (_sub(ref, n), _sub(ref_other, n)) for n in used}
            ref_lp = fn["reference_log_probs"](ref_graphs, ref_states, h, batch, zero)
            batch = batch.replace(ref_log_probs=ref_lp)

        embed_params, embed_frozen = _sub(params, "embed"), _sub(frozen, "embed")
        h = fn["embed"](
            self._graphs["embed"], embed_params, embed_frozen, ids, False, self._model.dtype
        )
        saved = []
        for i, lg in enumerate(self._layer_graphs):
            saved.append(h)
            layer_params, layer_frozen = _sub(params, "layers", i), _sub(frozen, "layers", i)
            h = fn["layer"](lg, layer_params, layer_frozen, h, cos, sin, mask, False)
        head_graphs = tuple((n, self._graphs[n]) for n in _used(self._tied))
        head_params = {n: _sub(params, n) for n in _used(self._tied)}
        head_frozen = {n: _sub(frozen, n) for n in _used(self._tied)}
        loss, metrics, d_head, dh = fn["head"](head_graphs, head_params, head_frozen, h, batch)
        pieces: dict[tuple, Any] = {("final_norm",): d_head["final_norm"]}
        if self._tied:
            pieces[("embed", "head")] = d_head["embed"]
        else:
            pieces[("lm_head",)] = d_head["lm_head"]
        for i in reversed(range(len(self._layer_graphs))):
            lg = self._layer_graphs[i]
            layer_params, layer_frozen = _sub(params, "layers", i), _sub(frozen, "layers", i)
            d_layer, dh = fn["layer_backward"](
                lg, layer_params, layer_frozen, saved.pop(), cos, sin, mask, dh
            )
            pieces[("layers", i)] = d_layer
        pieces[("embed",)] = fn["embed_backward"](
            self._graphs["embed"], _sub(params, "embed"), _sub(frozen, "embed"), ids, dh
        )
        split = self.optimizer_split(state)
        if split is None:
            return fn["finish"](params, state.opt_state, state.step, pieces, loss, metrics, batch)
        return self._finish_by_layer(split, state, pieces, loss, metrics, batch, fn)

    def _finish_by_layer(
        self,
        split: LayerSplit,
        state: GRPOTrainState,
        pieces: dict[tuple, Any],
        loss: Any,
        metrics: Any,
        batch: GRPOBatch,
        fn: dict[str, Any],
    ) -> Any:
        """Clipping, ``tx`` and the guard as ``apply_gradients``, one group at a time."""
        if self._tied:  # the embedding's two uses: lookup and output projection
            pieces = dict(pieces)
            pieces[("embed",)] = fn["add"](pieces[("embed",)], pieces.pop(("embed", "head")))
        grads = {}
        for group in split.groups:
            if group is not None:
                grads[group] = pieces[("layers", group)]
            else:
                rest = {k: v for k, v in pieces.items() if k[0] != "layers"}
                grads[group] = _assemble(group_tree(state.params, None), rest)
        return self._optimizer.run(fn, split, state, grads, loss, metrics, batch)

    def optimizer_split(self, state: GRPOTrainState) -> LayerSplit | None:
        """How the optimizer step runs one layer at a time for ``state``, or None.

        None where ``tx`` is not separable by layer (``split_by_layer``'s check): then the
        optimizer runs as one program over every parameter, as in the one-program update.
        :attr:`optimizer_split_reason` says why.

        Args:
            state: A train state (its structure, shapes and dtypes are read).

        Returns:
            The split, or None.
        """
        split, self.optimizer_split_reason = self._decisions(state.params, state.opt_state)
        return split

    def _programs_by_name(self) -> dict[str, Any]:
        return {
            "inputs": self._inputs,
            "reference_inputs": self._reference_inputs,
            "embed": self._embed,
            "layer": self._layer,
            "layer_backward": self._layer_backward,
            "embed_backward": self._embed_backward,
            "reference_log_probs": self._reference_log_probs,
            "head": self._head,
            "finish": self._finish,
            "add": self._add,
            **self._optimizer.programs,
        }

    def _jitted(self) -> dict[str, Any]:
        programs = self._programs_by_name()
        ready = self.take_ready()  # popped below: the thread keeps its own

        def prepare_apply(*args: Any) -> None:
            self._optimizer.prepare_apply(*args, wait=ready.pop("apply", None))

        if not ready:
            return dict(programs, prepare_apply=prepare_apply)

        def after(name: str, program: Any) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                future = ready.pop(name, None)
                if future is not None:  # its error, if any, is raised by the call itself
                    concurrent.futures.wait([future])
                return program(*args)

            return call

        wrapped = {name: after(name, program) for name, program in programs.items()}
        return dict(wrapped, prepare_apply=prepare_apply)

    def __call__(
        self, state: GRPOTrainState, batch: GRPOBatch
    ) -> tuple[GRPOTrainState, dict[str, jax.Array]]:
        """One GRPO update: ``(new_state, metrics)``, as ``jax.jit(grpo_train_step)`` returns.

        Args:
            state: The train state (the buffers of its parameters, optimizer state and step are
                donated to XLA and invalid afterwards).
            batch: A prepared batch.

        Returns:
            The new state and the metrics.
        """
        # Each program waits for its own background compilation (compile_ahead), so the first
        # update starts as soon as its first programs are compiled.
        (params, opt_state, step), metrics = self._run(state, batch, self._jitted())
        return state.replace(params=params, opt_state=opt_state, step=step), metrics

    def compile_ahead(self, state: GRPOTrainState, batch: GRPOBatch) -> concurrent.futures.Future:
        """Traces every program for ``state`` and ``batch`` here, compiles them in the background.

        As ``OneProgramEngine.compile_ahead``: only shapes, dtypes and shardings are read. The
        programs compile one after the other, in the order the update runs them; the next
        update runs each program once its own compilation is done (the optimizer's, the
        longest, is the last one it needs).

        Args:
            state: A train state.
            batch: A batch with the structure, shapes and dtypes of the batches to come.

        Returns:
            A future whose result is ``None`` once every program is compiled (or the first
            error).
        """
        self.wait()
        # The state and batch themselves (only their types are read, nothing runs): lowered
        # from them, the programs match the calls of the update to come.
        order = lower_programs(self._run, self._programs_by_name(), state, batch)
        return self.compile_in_background([order])

    def cache_size(self) -> int:
        """How many compiled variants the input program holds.

        Returns:
            One per batch structure compiled so far.
        """
        return self._inputs._cache_size()
