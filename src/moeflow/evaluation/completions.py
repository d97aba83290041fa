"""A generated completion as HumanEval's samples record it: the text, how it ended, its token counts.

Apart from the generation loop (``moeflow.evaluation.generation``, which needs torch, transformers and the ranks)
so that what reads and writes samples, the execution stage included, does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    text: str  # the generated text, cut before the first stop sequence
    finish: str  # "stop" (a stop sequence), "eos" or "length" (max_new_tokens)
    new_tokens: int  # tokens generated, the stop sequence's included (EOS and padding not)
    prompt_tokens: int
    prompt_truncated: bool  # the prompt lost its start to fit the model's context
