"""The training settings (``train:`` and ``pretrain:``) and each training stage's settings, typed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moeflow.model.settings import LoraSettings, ModelSettings
from moeflow.parallel.settings import ParallelSettings


@dataclass(frozen=True)
class BalanceSettings:
    """``train.balance`` / ``pretrain.balance``: the load-balancing terms of the loss (moeflow.train.losses)."""

    SCHEMA: ClassVar[str] = "#/$defs/balance"
    mode: str
    coef: float
    z_loss_coef: float
    bias_update_rate: float

    @property
    def balancing(self) -> bool:
        return self.mode != "off" and self.coef > 0

    @property
    def needs_router_grad(self) -> bool:
        """Whether a loss term differentiates through the router (else routing statistics carry no graph)."""
        return self.balancing or self.z_loss_coef > 0

    @property
    def needs_counting_forward(self) -> bool:
        return self.balancing and self.mode == "exact"


@dataclass(frozen=True)
class MuonSettings:
    """``train.muon`` (moeflow.train.optimizers)."""

    SCHEMA: ClassVar[str] = "#/$defs/muon"
    momentum: float
    nesterov: bool
    ns_steps: int
    adjust_lr: str


@dataclass(frozen=True)
class EsftSettings:
    """``train.esft`` (moeflow.train.esft): how the experts are chosen and what else trains."""

    SCHEMA: ClassVar[str] = "#/$defs/esft"
    score: str
    top_p: float
    token_budget: int
    train_shared_experts: bool
    train_non_expert: bool


@dataclass(frozen=True)
class MtpSettings:
    """``train.mtp`` with ``mode: train`` (moeflow.train.trainer, moeflow.model.mtp_loss): the MTP layers train,
    and the step loss adds ``loss_weight`` x the mean over depths of the MTP loss."""

    SCHEMA: ClassVar[str] = "#/$defs/mtp"
    mode: str
    loss_weight: float


@dataclass(frozen=True)
class RoutingThresholds:
    """``train.routing_guard`` (moeflow.train.guards.RoutingGuard)."""

    SCHEMA: ClassVar[str] = "#/$defs/routing_guard"
    window_steps: int
    max_load_ratio: float
    min_load_entropy: float
    max_dead_experts: int
    early_steps: int
    early_loss_drop: float
    early_entropy_drop: float
    reference: str
    max_load_ratio_growth: float
    max_load_entropy_drop: float


@dataclass(frozen=True)
class MemoryThresholds:
    """``train.memory_guard`` (moeflow.train.guards.MemoryGuard)."""

    SCHEMA: ClassVar[str] = "#/$defs/memory_guard"
    skip_steps: int
    window_steps: int
    max_slope_mib_per_step: float
    patience: int


@dataclass(frozen=True)
class TrainSettings:
    """The training loop's settings: a ``train:`` or ``pretrain:`` section after moeflow.workflow.keys.training
    (``warmup_steps`` is the resolved warmup length; ``lora`` is None unless ``method`` is lora, ``esft`` unless it
    is esft, ``muon`` unless ``optimizer`` is muon, ``mtp`` unless ``mtp.mode`` is train)."""

    SCHEMA: ClassVar[str] = "#/$defs/training"
    method: str
    optimizer: str
    micro_batch_size: int
    grad_accum_steps: int
    order: str
    gradient_checkpointing: bool
    steps: int
    warmup_steps: int
    warmup_ratio: float | None
    lr: float
    min_lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    max_grad_norm: float
    router_lr_multiplier: float
    freeze_router: bool
    lora: LoraSettings | None
    muon: MuonSettings | None
    esft: EsftSettings | None
    mtp: MtpSettings | None
    balance: BalanceSettings
    routing_guard: RoutingThresholds
    memory_guard: MemoryThresholds
    log_every: int
    eval_every: int
    eval_max_sequences: int | None
    checkpoint_every: int
    detect_anomaly: bool
    peak_flops_per_s: float | None

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def trained_mtp(self) -> MtpSettings | None:
        """``mtp`` where the MTP layers train (``mode: train``), else None (also for settings typed without
        moeflow.workflow.keys.training, which fills in the frozen default)."""
        return self.mtp if self.mtp is not None and self.mtp.mode == "train" else None


@dataclass(frozen=True)
class PretrainStage:
    """Rule pretrain_base (moeflow.workflow.keys.base_model_settings of a model built from config)."""

    model: ModelSettings
    pretrain: TrainSettings
    data: str
    precision: str
    seed: int


@dataclass(frozen=True)
class WarmupStage:
    """Rule warmup (moeflow.workflow.keys.warmup_settings)."""

    base: str
    data: str
    finetune_corpus: str
    model: ModelSettings
    hardware_device: str
    parallel: ParallelSettings
    train: TrainSettings
    precision: str
    seed: int


@dataclass(frozen=True)
class TrainModelStage:
    """Rule train_model (moeflow.workflow.keys.train_model_settings; ``export`` as
    moeflow.checkpoint.export.ExportSettings takes it)."""

    train: TrainSettings
    model: ModelSettings
    warmup: str
    parallel: ParallelSettings
    hardware_device: str
    export: dict[str, Any]
