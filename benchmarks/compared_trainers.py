"""The trainers the throughput benchmarks compare, set up once for benchmarks/train.py and
benchmarks/gpu_acceptance.py: moeflow's loop and the HF Trainer with the same optimizer and schedule (AdamW at
``LR``, betas 0.9/0.95, weight decay 0.1, clipping 1.0, one warmup step), the warm-up pass each takes before
the clock starts, and the step clock's intervals.
"""

from __future__ import annotations

import tempfile

from moeflow.settings import typed
from moeflow.train.settings import TrainSettings
from moeflow.workflow.keys import training

LR = 6e-5  # the recipe's (config/config.yaml's train.lr)


BALANCE_COEF = 0.01  # moeflow's balancing loss where a setup turns it on


def step_intervals(marks: list[float]) -> list[float]:
    """Seconds of each step: from the first step's start, then between consecutive step ends."""
    return [b - a for a, b in zip(marks, marks[1:])]


def logits_mean(model, batch):
    """A warm-up loss from the full logits of a collated batch (any setup can take it)."""
    from moeflow.data.collate import model_inputs

    return model(**model_inputs(model, batch), use_cache=False).logits.float().mean()


def chunked_loss(model, batch):
    """moeflow's loss of a collated batch: the chunked cross-entropy, no full logits."""
    from moeflow.data.collate import model_inputs
    from moeflow.model.chunked_loss import token_losses

    return token_losses(model, model_inputs(model, batch), batch["labels"]).loss


def hf_loss(model, batch):
    """The HF Trainer's loss of its batch (inputs and labels): the model's own, from the full logits."""
    return model(**batch, use_cache=False).loss


def warm_up(model, batch, autocast, loss=logits_mean) -> None:
    """One micro-batch forward and backward of ``loss`` before the clock starts (first-call allocations and
    kernel choices); gradients are dropped. The compared setups each warm up with the loss they train on,
    so that a warm-up never holds memory its setup's steps do not (the full logits, for moeflow)."""
    model.train()
    with autocast():
        value = loss(model, batch)
    value.backward()
    model.zero_grad(set_to_none=True)


def moeflow_settings(steps: int, micro: int, accum: int, balance_mode: str = "off") -> TrainSettings:
    """moeflow's loop in the compared shape: AdamW at LR with one warmup step, weight decay 0.1, clipping 1.0,
    the balancing loss in ``balance_mode`` (coef BALANCE_COEF), the memory guard off (a benchmark's steps)."""
    section = {
        "steps": steps,
        "lr": LR,
        "warmup_steps": 1,
        "micro_batch_size": micro,
        "grad_accum_steps": accum,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "balance": {"mode": balance_mode, "coef": BALANCE_COEF},
        "memory_guard": {"skip_steps": 10**6},
    }
    return typed(TrainSettings, training(section))


def packed_hf_batch(model):
    """The HF Trainer's collator on moeflow's packed rows: what the model takes (per-document attention from
    moeflow.data.collate), with the labels."""
    from moeflow.data.collate import collate, model_inputs

    def hf_batch(batch):
        rows = collate(batch)
        return {**model_inputs(model, rows), "labels": rows["labels"]}

    return hf_batch


def hf_train(model, examples, collator, mark, *, micro: int, accum: int, steps: int, **extra) -> None:
    """The HF Trainer with the recipe's arguments (AdamW at LR, betas 0.9/0.95, weight decay 0.1, clipping 1.0,
    cosine after one warmup step) for ``steps`` optimizer steps; ``mark()`` at the first step's start and at
    each step's end. ``extra``: ``checkpointing`` (the recipe's non-reentrant gradient checkpointing), ``bf16``,
    ``use_cpu`` (default: on)."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments

    class StepClock(TrainerCallback):
        def __init__(self):
            self.started = False

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.started:
                self.started = True
                mark()

        def on_step_end(self, args, state, control, **kwargs):
            mark()

    checkpointing = extra.pop("checkpointing", False)
    with tempfile.TemporaryDirectory() as tmp:
        arguments = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accum,
            learning_rate=LR,
            max_grad_norm=1.0,
            weight_decay=0.1,
            adam_beta2=0.95,
            max_steps=steps,
            lr_scheduler_type="cosine",
            warmup_steps=1,
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
            report_to=[],
            save_strategy="no",
            logging_steps=10**6,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            remove_unused_columns=False,
            optim="adamw_torch",
            **({"use_cpu": True} | extra),
        )
        HFTrainer(
            model=model, args=arguments, train_dataset=examples, data_collator=collator, callbacks=[StepClock()]
        ).train()
