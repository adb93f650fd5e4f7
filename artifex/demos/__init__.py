"""The built-in demos of ``artifex-grpo demo``, each a complete GRPO run on a small task.

:mod:`~artifex.demos.addition` (``--task addition``, the default) teaches a tiny Llama-style
model 2-digit addition: a supervised warm-up, then GRPO with an exact-answer reward; its model,
tokenizer and dataset are also the small fixtures of the tests and notebooks.
:mod:`~artifex.demos.tools` (``--task tools``) teaches the same kind of model to call a
``multiply`` tool in a multi-turn episode. :mod:`~artifex.demos.flow` (``--task flow``) runs
Flow-GRPO on a tiny flow-matching digit generator. A demo may import anything below it (the
library under ``artifex.generative_models``, and the other demos); nothing in the library
imports the demos, except the command line (``artifex.cli*``), which runs them.

Examples:
    >>> from artifex.demos import DemoConfig, ToolDemoConfig, FlowDemoConfig
    >>> DemoConfig().grpo_steps > 0 and ToolDemoConfig().grpo_steps > 0
    True
    >>> FlowDemoConfig().architecture
    'dit'
"""

from artifex.demos.addition import (
    DemoConfig,
    addition_dataset,
    demo_model,
    demo_tokenizer,
    digit_reward,
    plot_rewards,
    run_demo,
    supervised_warmup,
)
from artifex.demos.flow import (
    FlowDemoConfig,
    FlowDemoResult,
    build_flow_model,
    plot_flow_rewards,
    plot_image_grid,
    run_flow_demo,
)
from artifex.demos.tools import (
    TOOL_CHAT_TEMPLATE,
    ToolDemoConfig,
    multiplication_dataset,
    multiply,
    run_tool_demo,
    tool_demo_tokenizer,
    tool_warmup,
    tool_warmup_rows,
)

__all__ = [
    "TOOL_CHAT_TEMPLATE",
    "DemoConfig",
    "FlowDemoConfig",
    "FlowDemoResult",
    "ToolDemoConfig",
    "addition_dataset",
    "build_flow_model",
    "demo_model",
    "demo_tokenizer",
    "digit_reward",
    "multiplication_dataset",
    "multiply",
    "plot_flow_rewards",
    "plot_image_grid",
    "plot_rewards",
    "run_demo",
    "run_flow_demo",
    "run_tool_demo",
    "supervised_warmup",
    "tool_demo_tokenizer",
    "tool_warmup",
    "tool_warmup_rows",
]
