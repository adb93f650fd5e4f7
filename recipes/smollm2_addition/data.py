"""The recipe's task: chat prompts asking for A + B (A, B in 1..50), answer A + B.

    python recipes/smollm2_addition/data.py OUT_DIR   # writes OUT_DIR/train.jsonl, eval.jsonl

Training and held-out rows use disjoint (A, B) pairs, drawn with a fixed seed, so the files are
the same on every machine.
"""

from __future__ import annotations

import json
import os
import random
import sys

QUESTION = "What is {a} + {b}? Reply with only the number."
NUM_TRAIN = 512
NUM_EVAL = 100
HIGHEST = 50


def rows(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``(train, eval)``: rows ``{"prompt": [user message], "answer": "A+B"}``."""
    pairs = [(a, b) for a in range(1, HIGHEST + 1) for b in range(1, HIGHEST + 1)]
    random.Random(seed).shuffle(pairs)

    def row(a: int, b: int) -> dict:
        message = {"role": "user", "content": QUESTION.format(a=a, b=b)}
        return {"prompt": [message], "answer": str(a + b)}

    held_out = [row(a, b) for a, b in pairs[:NUM_EVAL]]
    train = [row(a, b) for a, b in pairs[NUM_EVAL : NUM_EVAL + NUM_TRAIN]]
    return train, held_out


def write(out: str) -> tuple[str, str]:
    """Writes ``out/train.jsonl`` and ``out/eval.jsonl``; returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, part in zip(("train", "eval"), rows(), strict=True):
        path = os.path.join(out, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in part)
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    print(*write(sys.argv[1] if len(sys.argv) > 1 else "."))
