"""The reward of the image example (docs/multimodal.md, docs/examples/gemma3_4B_image_grpo.yaml): 1.0 when the
completion's last line names the shape in the picture (the dataset's ``answer`` column), else 0.0.

    reward_functions:
      - _component_: torchtune_grpo.rewards.python_reward
        function: docs/examples/shape_reward.py:names_the_shape
        weight: 1.0
"""

from typing import List


def names_the_shape(completions: List[str], answer: List[str]) -> List[float]:
    """1.0 per completion whose last non-empty line contains its gold answer (case-insensitive), else 0.0.

    Examples::

        "It has three corners.\\nA triangle."  answer "triangle"  -> 1.0
        "A circle, or maybe a square"         answer "square"    -> 1.0
        "I cannot tell."                      answer "circle"    -> 0.0
    """
    scores = []
    for text, gold in zip(completions, answer):
        lines = [line for line in text.strip().splitlines() if line.strip()]
        scores.append(float(bool(lines) and gold.strip().lower() in lines[-1].lower()))
    return scores
