"""Small flow-matching image models (a DiT, a residual MLP), pretraining, image rewards."""

from artifex.generative_models.models.flow.dit import (
    FlowDiT,
    FlowDiTConfig,
    patchify,
    sincos_position_embeddings,
    unpatchify,
)
from artifex.generative_models.models.flow.io import load_flow_model, save_flow_model
from artifex.generative_models.models.flow.model import (
    FlowModel,
    FlowModelConfig,
    check_class_labels,
    timestep_features,
)
from artifex.generative_models.models.flow.rewards import (
    DigitClassifier,
    ImageReward,
    brightness_reward,
    classifier_reward,
    combine_image_rewards,
    compressibility_reward,
    train_classifier,
)
from artifex.generative_models.models.flow.training import (
    FlowTrainConfig,
    flow_matching_loss,
    load_digits_images,
    train_flow_matching,
)

__all__ = [
    "DigitClassifier",
    "FlowDiT",
    "FlowDiTConfig",
    "FlowModel",
    "FlowModelConfig",
    "FlowTrainConfig",
    "ImageReward",
    "brightness_reward",
    "check_class_labels",
    "classifier_reward",
    "combine_image_rewards",
    "compressibility_reward",
    "flow_matching_loss",
    "load_digits_images",
    "load_flow_model",
    "patchify",
    "save_flow_model",
    "sincos_position_embeddings",
    "timestep_features",
    "train_classifier",
    "train_flow_matching",
    "unpatchify",
]
