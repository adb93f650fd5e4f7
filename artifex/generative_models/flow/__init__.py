"""Flow-GRPO: GRPO on flow-matching image models, all of it in one package.

What it holds, bottom to top:

- the models: :mod:`~artifex.generative_models.flow.model` (a residual MLP),
  :mod:`~artifex.generative_models.flow.dit` (a class-conditioned DiT),
  :mod:`~artifex.generative_models.flow.text_dit` (a text-conditioned DiT), their saving and
  loading (:mod:`~artifex.generative_models.flow.io`), rectified-flow pretraining
  (:mod:`~artifex.generative_models.flow.pretraining`) and the pretraining of a text encoder
  that is then kept frozen (:mod:`~artifex.generative_models.flow.text_encoder`);
- the data and rewards: the captioned shapes (:mod:`~artifex.generative_models.flow.shapes`),
  the GenEval-style checks of an image against its caption
  (:mod:`~artifex.generative_models.flow.detection`), and image rewards with their adapters to
  the training loop's reward protocol (:mod:`~artifex.generative_models.flow.rewards`);
- sampling: the SDE and its Gaussian transitions (:mod:`~artifex.generative_models.flow.sde`)
  and the ODE/SDE samplers (:mod:`~artifex.generative_models.flow.sampling`);
- GRPO on trajectories: the flow ``GRPOBatch`` layout, the log-prob hook and the exact KL
  (:mod:`~artifex.generative_models.flow.batch`), the loss as a function
  (:mod:`~artifex.generative_models.flow.objective`);
- the training loop's integration: :class:`FlowRollout` samples SDE trajectories and packs them
  into the flow ``GRPOBatch``, :class:`FlowEvaluator` scores ODE samples of held-out prompts and
  writes image grids (:mod:`~artifex.generative_models.flow.rollout`,
  :mod:`~artifex.generative_models.flow.images`), and :func:`train_flow` runs a flow model
  through the same loop as a language model (:mod:`~artifex.generative_models.flow.train`).

What it may import: the library below it (``models``, ``inference``, ``training``, ``utils``)
and itself. Nothing below imports it: the demos (``artifex.demos``), the command line
(``artifex.cli*``) and the deprecated modules at the old paths (``models.flow``,
``inference.flow_sampling``, ``training.rl.flow_batch``, ``training.rl.flow_objective``) are
its only importers in the library (``tests/test_import_graph.py`` checks it).
"""

from artifex.generative_models.flow.batch import (
    FlowConditioning,
    FlowLogProbFn,
    flow_kl,
    flow_log_prob_fn,
    to_grpo_batch,
)
from artifex.generative_models.flow.detection import (
    DetectedShape,
    compositional_accuracy,
    compositional_reward,
    detect_shapes,
    scene_checks,
)
from artifex.generative_models.flow.dit import (
    FlowDiT,
    FlowDiTConfig,
    patchify,
    sincos_position_embeddings,
    unpatchify,
)
from artifex.generative_models.flow.images import (
    as_images,
    describe_shapes,
    image_grid,
    write_png,
)
from artifex.generative_models.flow.io import load_flow_model, save_flow_model
from artifex.generative_models.flow.model import (
    FlowModel,
    FlowModelConfig,
    check_class_labels,
    timestep_features,
)
from artifex.generative_models.flow.objective import flow_grpo_objective
from artifex.generative_models.flow.pretraining import (
    FlowTrainConfig,
    flow_matching_loss,
    load_digits_images,
    train_flow_matching,
)
from artifex.generative_models.flow.rewards import (
    DigitClassifier,
    ImageReward,
    brightness_reward,
    classifier_reward,
    combine_image_rewards,
    compositional,
    compositional_correct,
    compositional_counts,
    compressibility_reward,
    image_reward,
    train_classifier,
)
from artifex.generative_models.flow.rollout import (
    FlowEvaluator,
    FlowRollout,
    FlowRolloutResult,
    encode_flow_prompts,
)
from artifex.generative_models.flow.sampling import (
    FlowSampler,
    FlowTrajectory,
    check_prompts,
    sample_flow,
    sde_step,
)
from artifex.generative_models.flow.sde import (
    MAX_NOISE_LEVEL,
    SDEConfig,
    gaussian_kl,
    gaussian_log_prob,
    sde_transition,
    time_grid,
)
from artifex.generative_models.flow.shapes import (
    SHAPES_VOCABULARY,
    ObjectGroup,
    Scene,
    WordTokenizer,
    all_captions,
    draw_scene,
    make_shapes_dataset,
    parse_caption,
    split_captions,
)
from artifex.generative_models.flow.text_dit import (
    TextFlowDiT,
    TextFlowDiTConfig,
    check_token_ids,
)
from artifex.generative_models.flow.text_encoder import (
    TextPretrainConfig,
    layout_accuracy,
    pretrain_text_encoder,
)
from artifex.generative_models.flow.train import flow_trainer, train_flow

__all__ = [
    "MAX_NOISE_LEVEL",
    "SHAPES_VOCABULARY",
    "DetectedShape",
    "DigitClassifier",
    "FlowConditioning",
    "FlowDiT",
    "FlowDiTConfig",
    "FlowEvaluator",
    "FlowLogProbFn",
    "FlowModel",
    "FlowModelConfig",
    "FlowRollout",
    "FlowRolloutResult",
    "FlowSampler",
    "FlowTrainConfig",
    "FlowTrajectory",
    "ImageReward",
    "ObjectGroup",
    "SDEConfig",
    "Scene",
    "TextFlowDiT",
    "TextFlowDiTConfig",
    "TextPretrainConfig",
    "WordTokenizer",
    "all_captions",
    "as_images",
    "brightness_reward",
    "check_class_labels",
    "check_prompts",
    "check_token_ids",
    "classifier_reward",
    "combine_image_rewards",
    "compositional",
    "compositional_accuracy",
    "compositional_correct",
    "compositional_counts",
    "compositional_reward",
    "compressibility_reward",
    "describe_shapes",
    "detect_shapes",
    "draw_scene",
    "encode_flow_prompts",
    "flow_grpo_objective",
    "flow_kl",
    "flow_log_prob_fn",
    "flow_matching_loss",
    "flow_trainer",
    "gaussian_kl",
    "gaussian_log_prob",
    "image_grid",
    "image_reward",
    "layout_accuracy",
    "load_digits_images",
    "load_flow_model",
    "make_shapes_dataset",
    "parse_caption",
    "patchify",
    "pretrain_text_encoder",
    "sample_flow",
    "save_flow_model",
    "scene_checks",
    "sde_step",
    "sde_transition",
    "sincos_position_embeddings",
    "split_captions",
    "time_grid",
    "timestep_features",
    "to_grpo_batch",
    "train_classifier",
    "train_flow",
    "train_flow_matching",
    "unpatchify",
    "write_png",
]
