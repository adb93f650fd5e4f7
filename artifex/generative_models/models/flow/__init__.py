"""Flow-matching image models (class- and text-conditioned DiTs, an MLP), data and rewards.

Their pretraining and saving, a captioned shapes data set, and image rewards (a digit
classifier's, brightness, compressibility, and a GenEval-style compositional rule).
"""

from artifex.generative_models.models.flow.compositional import (
    DetectedShape,
    compositional_accuracy,
    compositional_reward,
    detect_shapes,
    scene_checks,
)
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
from artifex.generative_models.models.flow.shapes import (
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
from artifex.generative_models.models.flow.text_dit import (
    TextFlowDiT,
    TextFlowDiTConfig,
    check_token_ids,
)
from artifex.generative_models.models.flow.training import (
    FlowTrainConfig,
    flow_matching_loss,
    load_digits_images,
    train_flow_matching,
)

__all__ = [
    "SHAPES_VOCABULARY",
    "DetectedShape",
    "DigitClassifier",
    "FlowDiT",
    "FlowDiTConfig",
    "FlowModel",
    "FlowModelConfig",
    "FlowTrainConfig",
    "ImageReward",
    "ObjectGroup",
    "Scene",
    "TextFlowDiT",
    "TextFlowDiTConfig",
    "WordTokenizer",
    "all_captions",
    "brightness_reward",
    "check_class_labels",
    "check_token_ids",
    "classifier_reward",
    "combine_image_rewards",
    "compositional_accuracy",
    "compositional_reward",
    "compressibility_reward",
    "detect_shapes",
    "draw_scene",
    "flow_matching_loss",
    "load_digits_images",
    "load_flow_model",
    "make_shapes_dataset",
    "parse_caption",
    "patchify",
    "save_flow_model",
    "scene_checks",
    "sincos_position_embeddings",
    "split_captions",
    "timestep_features",
    "train_classifier",
    "train_flow_matching",
    "unpatchify",
]
