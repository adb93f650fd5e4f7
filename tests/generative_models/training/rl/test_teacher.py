"""Distillation in the update: a float64 NumPy step, microbatches, a mesh, larger teachers.

The teacher is held like the reference, frozen beside the train state; these tests check the
update against a NumPy step for a categorical policy (each divergence), that splitting the batch
into microbatches or over a 2-device mesh gives the unsliced update, that a teacher of another
size than the student works, that the batch's ``teacher_log_probs`` replace the teacher's pass,
that packed batches give the padded batch's update, and what is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl.state import init_train_state, make_grpo_train_step
from artifex.generative_models.training.rl.teacher import (
    causal_lm_distillation,
    make_distillation_terms,
)
from artifex.generative_models.training.sharding import make_mesh
from tests.generative_models.training.rl.test_distillation import (
    np_divergence,
    np_divergence_grad,
    np_log_softmax,
)

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
VOCAB = 40
STUDENT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16,
)  # fmt: skip
TEACHER = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=3,
    num_kv_heads=3, head_dim=16,
)  # fmt: skip


class MLP(nnx.Module):
    """A categorical teacher of another shape than the linear student."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def _np_mlp(teacher: MLP, x: np.ndarray) -> np.ndarray:
    f64 = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    h = np.tanh(x @ f64(teacher.hidden.kernel) + f64(teacher.hidden.bias))
    return h @ f64(teacher.out.kernel) + f64(teacher.out.bias)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_one_update_matches_numpy(divergence):
    """Pure distillation, plain SGD: the new weights are ``W - lr * lambda * dL/dW``."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4))
    actions = np.array([0, 1, 2, 2, 1, 0])
    student = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    teacher = MLP(nnx.Rngs(1))
    w0 = np.asarray(student.kernel[...], np.float64)
    b0 = np.asarray(student.bias[...], np.float64)
    lr, coeff, tau = 0.5, 0.7, 0.8
    config = GRPOConfig(
        num_generations=2, beta=0.0, entropy_coeff=0.0, max_grad_norm=None, temperature=tau,
        policy_loss_coeff=0.0, distillation_coeff=coeff, distillation_divergence=divergence,
        **({"jsd_beta": 0.3} if divergence == "jsd" else {}),
    )  # fmt: skip
    optimizer = nnx.Optimizer(student, optax.sgd(lr), wrt=nnx.Param)
    trainer = GRPOTrainer(student, optimizer, config, teacher_model=teacher)
    metrics = trainer.train_step(
        {"observations": x, "actions": actions, "rewards": np.ones(6)}  # no reward signal
    )

    zs, zt = (x @ w0 + b0) / tau, _np_mlp(teacher, x) / tau
    if divergence == "reverse_kl":
        ls, lt = np_log_softmax(zs), np_log_softmax(zt)
        d = ls[np.arange(6), actions] - lt[np.arange(6), actions]
        value = d.mean()
        g_z = d[:, None] * (np.eye(3)[actions] - np.exp(ls))
    else:
        value = np_divergence(zs, zt, divergence, 0.3).mean()
        g_z = np_divergence_grad(zs, zt, divergence, 0.3)
    g_z = coeff * g_z / 6 / tau  # the mean over rows, z = (x W + b) / tau
    np.testing.assert_allclose(metrics[f"distill/{divergence}"], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["total_loss"], coeff * value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(student.kernel[...], w0 - lr * x.T @ g_z, atol=1e-6)
    np.testing.assert_allclose(student.bias[...], b0 - lr * g_z.sum(0), atol=1e-6)
    assert int(optimizer.step[...]) == 1  # applied although every reward is equal


def _batch(seed: int = 0, rows: int = 8, group: int = 2) -> GRPOBatch:
    rng = np.random.default_rng(seed)
    p, t = 4, 6
    prompts = np.repeat(rng.integers(1, VOCAB, (rows // group, p)), group, 0)
    prompt_mask = np.ones((rows, p), np.int32)
    prompt_mask[:group, :1] = 0  # a left-padded prompt
    lengths = rng.integers(1, t + 1, rows)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    return GRPOBatch(
        prompt_ids=prompts.astype(np.int32), prompt_mask=prompt_mask,
        completion_ids=rng.integers(1, VOCAB, (rows, t)).astype(np.int32),
        completion_mask=mask, rewards=rng.uniform(0, 1, rows).astype(np.float32),
        group_size=group,
    )  # fmt: skip


def _trainer(divergence: str, *, mesh=None, teacher=True, **config) -> GRPOTrainer:
    student = CausalLM(CausalLMConfig.tiny(**STUDENT), rngs=nnx.Rngs(0))
    options = dict(num_generations=2, beta=0.04, distillation_coeff=0.5)
    options.update(config)
    cfg = GRPOConfig(distillation_divergence=divergence, **options)
    return GRPOTrainer(
        student,
        nnx.Optimizer(student, optax.adam(1e-3), wrt=nnx.Param),
        cfg,
        reference_model=CausalLM(CausalLMConfig.tiny(**STUDENT), rngs=nnx.Rngs(2)),  # KL > 0
        teacher_model=CausalLM(CausalLMConfig.tiny(**TEACHER), rngs=nnx.Rngs(1))
        if teacher
        else None,
        mesh=mesh,
    )


def _params(trainer: GRPOTrainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


@pytest.fixture(scope="module")
def unsliced():
    """``unsliced(divergence)``: the metrics and parameters after ``_trainer(divergence)``'s
    update of ``_batch()`` in one piece, run once per module: the update the tests of
    microbatches, a mesh, batch teacher log-probs and packing compare theirs to."""
    runs = {}

    def run(divergence: str) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        if divergence not in runs:
            trainer = _trainer(divergence)
            metrics = trainer.train_step(_batch(), num_microbatches=1)
            runs[divergence] = (jax.tree.map(np.asarray, metrics), _params(trainer))
        return runs[divergence]

    return run


# "forward_kl" runs the same code path as "jsd" (the teacher's full distribution through
# causal_lm_distillation; only the per-token formula differs, and test_one_update_matches_numpy
# and test_full_divergences_against_a_float64_forward check it): "reverse_kl" (the teacher's
# sampled log-probs) and "jsd" cover both ways a microbatch or a shard reaches the teacher.
@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_microbatches_and_a_mesh_give_the_unsliced_update(unsliced, divergence):
    """GRPO + KL + distillation from a larger teacher: 4 microbatches, each split over 2
    devices, give the update of the whole batch on one.

    The microbatches are the same scan of slices with or without a mesh (the mesh only places
    each slice's rows), so one sliced and sharded run checks both against the unsliced one.
    """
    metrics, params = unsliced(divergence)
    assert metrics[f"distill/{divergence}"] > 0 or divergence == "reverse_kl"
    assert metrics["grad_norm"] > 0 and metrics["kl"] > 0 and metrics["advantage_std"] > 0
    sliced = _trainer(divergence, mesh=make_mesh(data=2, devices=jax.devices()[:2]))
    other = sliced.train_step(_batch(), num_microbatches=4)
    for key in ("total_loss", "policy_loss", "entropy", "kl", f"distill/{divergence}", "grad_norm"):
        np.testing.assert_allclose(other[key], metrics[key], rtol=2e-4, atol=2e-6, err_msg=key)
    for a, b in zip(_params(sliced), params, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_full_divergences_against_a_float64_forward(divergence):
    """The teacher pass (another width, depth and head count) against NumPy on the logits."""
    batch = _batch(1, rows=4)
    student = CausalLM(CausalLMConfig.tiny(**STUDENT), rngs=nnx.Rngs(0))
    teacher = CausalLM(CausalLMConfig.tiny(**TEACHER), rngs=nnx.Rngs(1))
    _, _, got = causal_lm_distillation(
        student, teacher, batch, divergence=divergence, beta=0.4, temperature=0.9, chunk_size=5
    )
    p = batch.prompt_ids.shape[1]
    t = batch.completion_ids.shape[1]
    ids = np.concatenate([batch.prompt_ids, batch.completion_ids], 1)
    mask = np.concatenate([batch.prompt_mask, np.ones_like(batch.completion_ids)], 1)
    logits = [
        np.asarray(m(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), np.float64)[
            :, p - 1 : p + t - 1
        ]
        / 0.9
        for m in (student, teacher)
    ]
    np.testing.assert_allclose(got, np_divergence(*logits, divergence, 0.4), atol=2e-5)


def test_batch_teacher_log_probs_replace_the_teacher_pass(unsliced):
    batch = _batch()
    with_teacher = _trainer("reverse_kl")  # its teacher's log-probs; its update: unsliced's
    teacher = with_teacher.teacher_model
    scorer = make_distillation_terms(
        with_teacher.model, teacher, with_teacher.config
    ).teacher_log_prob_fn
    teacher_lp, _ = scorer(teacher, batch)
    expected, expected_params = unsliced("reverse_kl")

    given = _trainer("reverse_kl", teacher=False)
    with pytest.raises(ValueError, match="teacher_log_probs"):
        given.train_step(batch)
    got = given.train_step(batch.replace(teacher_log_probs=np.asarray(teacher_lp)))
    for key in ("total_loss", "distill/reverse_kl", "grad_norm"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(_params(given), expected_params, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="teacher_log_probs must be log-probabilities"):
        given.train_step(batch.replace(teacher_log_probs=np.ones((8, 6), np.float32)))


def test_packed_batches_give_the_padded_update(unsliced):
    batch = _batch()
    expected, _ = unsliced("reverse_kl")  # padded
    packed = _trainer("reverse_kl")
    packed.packing_threshold = 0.0
    assert type(packed.maybe_pack(packed.prepare_batch(batch))).__name__ == "PackedGRPOBatch"
    got = packed.train_step(batch)
    for key in ("total_loss", "distill/reverse_kl", "entropy", "kl", "grad_norm"):
        np.testing.assert_allclose(got[key], expected[key], rtol=2e-4, atol=2e-6)
    full = _trainer("jsd", beta=0.0)
    full.packing_threshold = 0.0
    prepared = full.prepare_batch(batch)
    assert full.maybe_pack(prepared) is prepared  # the full distributions run padded


def test_the_pure_step_and_checkpoints_hold_the_teacher_beside_the_state():
    trainer = _trainer("forward_kl")
    assert trainer.state.teacher is not None
    assert trainer.checkpoint_state().teacher is None
    assert trainer.checkpoint_state().reference is None
    step = jax.jit(
        make_grpo_train_step(
            trainer.model, trainer.optimizer.tx, trainer.config,
            reference_model=trainer.reference_model, teacher_model=trainer.teacher_model,
        )
    )  # fmt: skip
    state = init_train_state(
        trainer.model, trainer.optimizer,
        reference_model=trainer.reference_model, teacher_model=trainer.teacher_model,
    )  # fmt: skip
    state, metrics = step(state, trainer.prepare_batch(_batch(4)))
    assert float(metrics["update_applied"]) == 1.0 and float(metrics["distill/forward_kl"]) > 0
    restored = trainer.checkpoint_state()
    trainer.load_checkpoint_state(restored)
    assert trainer.state.teacher is not None


def test_make_grpo_loss_reads_the_teacher(unsliced):
    trainer = _trainer("jsd")
    batch = trainer.compute_log_probs(_batch())  # with the reference's log-probs (the KL term)
    (loss, metrics), grads = jax.value_and_grad(trainer.grpo_loss, has_aux=True)(
        trainer.params, batch
    )
    assert float(metrics["distill/jsd"]) > 0 and float(metrics["kl"]) > 0
    assert np.isfinite(float(loss)) and float(optax.global_norm(grads)) > 0
    step_metrics, _ = unsliced("jsd")  # the update of _batch() by a trainer built as this one
    np.testing.assert_allclose(step_metrics["total_loss"], float(loss), rtol=1e-5)


def test_refusals():
    student = CausalLM(CausalLMConfig.tiny(**STUDENT), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(student, optax.sgd(0.1), wrt=nnx.Param)
    teacher = CausalLM(CausalLMConfig.tiny(**TEACHER), rngs=nnx.Rngs(1))
    on = GRPOConfig(distillation_coeff=1.0)
    with pytest.raises(ValueError, match="distillation_coeff is 0"):
        GRPOTrainer(student, opt, GRPOConfig(), teacher_model=teacher)
    with pytest.raises(ValueError, match="another model"):
        GRPOTrainer(student, opt, on, teacher_model=student)
    with pytest.raises(TypeError, match=r"nnx\.Module"):
        GRPOTrainer(student, opt, on, teacher_model=lambda x: x)
    jsd = GRPOConfig(distillation_coeff=1.0, distillation_divergence="jsd")
    with pytest.raises(ValueError, match="needs a teacher_model"):
        GRPOTrainer(student, opt, jsd)
    with pytest.raises(ValueError, match="custom"):
        GRPOTrainer(student, opt, jsd, teacher_model=teacher, log_prob_fn=lambda m, b: (0, 0))
    other_vocab = CausalLM(CausalLMConfig.tiny(**{**TEACHER, "vocab_size": 64}), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="vocabulary"):
        GRPOTrainer(student, opt, jsd, teacher_model=other_vocab)
    small_vocab = CausalLM(CausalLMConfig.tiny(**{**TEACHER, "vocab_size": 32}), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="smaller than the student"):
        GRPOTrainer(student, opt, on, teacher_model=small_vocab)
    with pytest.raises(TypeError, match="kind of model"):
        GRPOTrainer(student, opt, on, teacher_model=nnx.Linear(4, VOCAB, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="without a mesh"):
        GRPOTrainer(student, opt, on, teacher_model=teacher, teacher_partition_rules=[])


def test_the_command_distills_from_a_teacher_directory(tmp_path, capsys):
    """``artifex-grpo train --teacher-model DIR --distillation-coeff ...``: one step, logged."""
    import json

    from artifex.cli import main
    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer

    tok = demo_tokenizer()
    # the demo model's tokens and sizes with one decoder layer; a teacher wider and deeper
    one_layer = demo_model(tok).config.replace(num_layers=1)
    CausalLM(one_layer, rngs=nnx.Rngs(0)).save_pretrained(str(tmp_path / "student"))
    tok.save_pretrained(str(tmp_path / "student"))
    wide = dict(vocab_size=tok.vocab_size, hidden_size=96, intermediate_size=128, num_layers=2)
    CausalLM(CausalLMConfig.tiny(**wide), rngs=nnx.Rngs(3)).save_pretrained(str(tmp_path / "big"))
    rows, _ = addition_dataset(num_eval=4)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    common = ["train", "--model", str(tmp_path / "student"), "--data", str(data)]
    common += ["--reward", "math", "--num-steps", "1", "--prompts-per-step", "2"]
    common += ["--num-generations", "2", "--max-new-tokens", "3", "--progress", "false"]
    common += ["--checkpoint-dir", "none", "--log-dir", str(tmp_path / "logs")]
    common += ["--output", str(tmp_path / "out"), "--beta", "0"]  # no reference: distillation
    teacher = ["--teacher-model", str(tmp_path / "big")]
    distill = ["--distillation-coeff", "1.0", "--distillation-divergence", "jsd"]
    distill += ["--jsd-beta", "0.3", "--policy-loss-coeff", "0"]

    assert main([*common, *teacher]) == 2
    assert "give --distillation-coeff > 0" in capsys.readouterr().err
    assert main([*common, *distill]) == 2
    assert "give --teacher-model DIR" in capsys.readouterr().err
    assert main([*common, "--teacher-model", str(tmp_path / "none"), *distill]) == 2
    assert "--teacher-model directory not found" in capsys.readouterr().err

    assert main([*common, *teacher, *distill]) == 0
    logged = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").open()]
    step = [m for m in logged if "distill/jsd" in m]
    assert len(step) == 1 and step[0]["distill/jsd"] > 0
    np.testing.assert_allclose(step[0]["distill/penalty"], step[0]["distill/jsd"], rtol=1e-6)
