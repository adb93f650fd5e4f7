"""A reward for tests whose untrained models answer nothing right.

An update whose advantages are all zero is skipped (``GRPOConfig.update_without_advantage``),
so a test that needs its steps to train gives completions rewards that differ within a group:
here a function of the completion's text. ``--reward tests.spread_reward:text_reward`` on the
command line (run from the repository root).
"""

from __future__ import annotations


def text_reward(prompts, completions, **columns):
    """``sum of the code points of the completion mod 7``: differs between most completions."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]
