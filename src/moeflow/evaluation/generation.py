"""Batched text generation with a causal LM: left-padded prompts, greedy or sampled, ending at stop sequences.

``model.generate`` runs the model's own forward without labels (logits for the next token; moeflow's
chunked training loss is not involved). Rows stop one by one: at EOS, or once their generated text
contains a stop sequence (:class:`StopOnSequences`), and the completion is cut before the first stop
sequence. Sampling is seeded per batch (``seed + batch index``), so a batch's draws do not depend on how
long earlier batches ran: on the CPU the same settings give the same completions.

With several ranks holding the model (FSDP, expert parallelism), rank r generates batches r, r + world, ...,
its forwards in step with the other ranks' (``moeflow.parallel.lockstep``: how many forwards a batch takes
depends on when its rows stop), and every rank gets every completion back in the prompts' order: the same
completions as one process's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from moeflow.evaluation.completions import Completion
from moeflow.parallel.layouts import generation_model
from moeflow.parallel.lockstep import forwards_in_step
from moeflow.parallel.process_group import Ranks, gather_objects
from moeflow.runtime.host_copies import model_device
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


def context_room(limit: int | None, decoding: Decoding) -> int | None:
    """How many prompt tokens fit beside ``max_new_tokens`` in a context of ``limit`` tokens (the model's
    max_position_embeddings; None: no stated limit, none either)."""
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
    ranks: Ranks | None = None,
) -> list[Completion]:
    """One completion per prompt (repeat a prompt for several samples), ``batch_size`` rows per call; with
    several ``ranks`` holding ``model``, the batches shared among them and every completion on every rank."""
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
    room = context_room(getattr(model.config, "max_position_embeddings", None), decoding)
    encoded = [prompt_ids(tokenizer, p, room) for p in prompts]
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    batches = list(enumerate(range(0, len(encoded), batch_size)))
    mine = batches[rank::world]
    model.eval()
    out: list[list[Completion]] = []
    with generation_model(model) as generator:
        device = model_device(generator)
        filler = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
        # several ranks: generate's own step synchronisation (synced_gpus) is off, forwards_in_step pairs them
        in_step = forwards_in_step(generator, filler) if world > 1 else contextlib.nullcontext()
        with in_step, torch.no_grad():
            for index, start in progress(mine, total=len(mine), desc=desc):
                batch = encoded[start : start + batch_size]
                width = max(len(ids) for ids, _ in batch)
                input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=device)
                mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
                torch.manual_seed(seed + index)
                rows = generator.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    generation_config=config,
                    stopping_criteria=StoppingCriteriaList([StopOnSequences(tokenizer, width, stops)]),
                    synced_gpus=False,
                )
                out.append(
                    [
                        completion(tokenizer, row, stops, len(ids), truncated)
                        for (ids, truncated), row in zip(batch, rows[:, width:].tolist())
                    ]
                )
    if world == 1:
        return [c for part in out for c in part]
    parts = gather_objects(out)  # rank r's k-th batch is batch r + k * world
    return [c for k in range(len(batches)) for c in parts[k % world][k // world]]


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
