"""Batched text generation with a causal LM: left-padded prompts, greedy or sampled, ending at stop sequences.

``model.generate`` runs the model's own forward without labels (logits for the next token; moeflow's
chunked training loss is not involved). Rows stop one by one: at EOS, or once their generated text
contains a stop sequence (:class:`StopOnSequences`), and the completion is cut before the first stop
sequence. Sampling is seeded per batch (``seed + batch index``), so a batch's draws do not depend on how
long earlier batches ran: on the CPU the same settings give the same completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from moeflow.runtime.stage import progress


class GenerationError(ValueError):
    """Generation settings this model cannot honour, with the key to change."""


@dataclass(frozen=True)
class Decoding:
    """How rows are decoded: greedy (``temperature`` None) or sampled with ``temperature`` and ``top_p``."""

    max_new_tokens: int
    temperature: float | None = None
    top_p: float = 1.0

    @property
    def sampling(self) -> bool:
        return self.temperature is not None


@dataclass(frozen=True)
class Completion:
    text: str  # the generated text, cut before the first stop sequence
    finish: str  # "stop" (a stop sequence), "eos" or "length" (max_new_tokens)
    new_tokens: int  # tokens generated, the stop sequence's included (EOS and padding not)
    prompt_tokens: int
    prompt_truncated: bool  # the prompt lost its start to fit the model's context


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` before the first stop sequence, and whether there was one."""
    positions = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(positions)], True) if positions else (text, False)


class StopOnSequences(StoppingCriteria):
    """Per row: done once the text generated after the prompt (the last ``prompt_length`` columns are the
    prompt's) contains a stop sequence."""

    def __init__(self, tokenizer: Any, prompt_length: int, stops: Sequence[str]):
        self.tokenizer, self.prompt_length, self.stops = tokenizer, prompt_length, tuple(stops)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length :], skip_special_tokens=True)
        done = [any(s in t for s in self.stops) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def prompt_ids(tokenizer: Any, prompt: str, room: int | None) -> tuple[list[int], bool]:
    """The prompt's token ids, keeping the last ``room`` (the end holds what is to be completed)."""
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if room is not None and len(ids) > room:
        return ids[-room:], True
    return ids, False


def context_room(model: Any, decoding: Decoding) -> int | None:
    """How many prompt tokens fit beside ``max_new_tokens`` in the model's context (None: no stated limit)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return None
    room = int(limit) - decoding.max_new_tokens
    if room < 1:
        raise GenerationError(
            f"config key 'evaluate.humaneval.max_new_tokens' ({decoding.max_new_tokens}) leaves no room for a prompt "
            f"in the model's context of {limit} tokens (max_position_embeddings); lower it"
        )
    return room


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    decoding: Decoding,
    stops: Sequence[str],
    batch_size: int,
    seed: int,
    desc: str = "generate",
) -> list[Completion]:
    """One completion per prompt (repeat a prompt for several samples), ``batch_size`` rows per call."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=decoding.max_new_tokens,
        do_sample=decoding.sampling,
        temperature=decoding.temperature if decoding.sampling else None,
        top_p=decoding.top_p if decoding.sampling else None,
        top_k=0 if decoding.sampling else None,  # top_p alone, as in the benchmark's sampling
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    room = context_room(model, decoding)
    encoded = [prompt_ids(tokenizer, p, room) for p in prompts]
    device = next(model.parameters()).device
    model.eval()
    out: list[Completion] = []
    starts = range(0, len(encoded), batch_size)
    for index, start in enumerate(progress(starts, total=len(starts), desc=desc)):
        batch = encoded[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        torch.manual_seed(seed + index)
        with torch.no_grad():
            rows = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([StopOnSequences(tokenizer, width, stops)]),
            )
        for (ids, truncated), row in zip(batch, rows[:, width:].tolist()):
            out.append(completion(tokenizer, row, stops, len(ids), truncated))
    return out


def completion(tokenizer: Any, new_ids: list[int], stops: Sequence[str], prompt_tokens: int, truncated: bool):
    """A row's generated ids as a :class:`Completion`: up to EOS, without the padding after a row finished."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ended = eos in new_ids
    if ended:
        new_ids = new_ids[: new_ids.index(eos)]
    while new_ids and new_ids[-1] == pad:
        new_ids = new_ids[:-1]
    text, stopped = cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), stops)
    finish = "stop" if stopped else "eos" if ended else "length"
    return Completion(text, finish, len(new_ids), prompt_tokens, truncated)
