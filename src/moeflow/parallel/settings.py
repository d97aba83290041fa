"""The ``parallel`` section's typed settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ParallelSettings:
    """``parallel``: the torchrun ranks and how they share the model (moeflow.parallel)."""

    SCHEMA: ClassVar[str] = "#/properties/parallel"
    nproc_per_node: int
    nnodes: int
    strategy: str
    ep_size: int
    fsdp_size: int | None
    ep_implementation: str
    cpu_offload: bool = False

    @property
    def world_size(self) -> int:
        """The ranks the config asks for: ``nproc_per_node x nnodes``."""
        return self.nproc_per_node * self.nnodes


def training_layout_problems(
    method: str,
    strategy: str,
    world: int,
    tied_embeddings: bool = False,
    model_type: str | None = None,
    fsdp2: bool | None = None,
    cpu_offload: bool = False,
    lora_router: str = "frozen",
    lora_targets: tuple[str, ...] = (),
) -> list[str]:
    """What a training layout cannot run, each naming the keys and what to do. The config check, the loader
    (moeflow.loading.factory) and the planner's proposals (moeflow.plan.proposals) refuse the same layouts:
    expert parallelism with tied embeddings (transformers 5's expert-parallel sharding unties them), LoRA adapters
    under FSDP1, and under expert parallelism a router adapter (``lora_router``) or the routed experts alone
    (``lora_targets``: moeflow.model.expert_lora's adapters go beside peft's, which need a module), ESFT under
    FSDP1 on fused expert tensors (``model_type``'s: its flat shards split elements, not experts), and
    ``cpu_offload`` (FSDP2's offload policy) anywhere but ``fsdp`` on FSDP2. Expert parallelism on transformers
    4.57 is refused where the model is loaded (moeflow.parallel.layouts), not here: a plan on the pinned stack may
    be for a cluster that runs the current one. ``fsdp2``: whether FSDP is FSDP2 (None: this stack's torch says;
    docs/training.md's table is for the current stack). Imports nothing heavy: the config check runs at DAG build."""
    from moeflow.families import registry
    from moeflow.runtime import compat

    fsdp2 = compat.fsdp2_available() if fsdp2 is None else fsdp2
    problems = []
    if strategy == "ep" and tied_embeddings:
        problems.append(
            "config key 'parallel.strategy': ep with a model whose embedding and output layer are tied "
            "(tie_word_embeddings): transformers 5's expert-parallel sharding unties them during training. Use "
            "parallel.strategy: fsdp for this model, or a model with tie_word_embeddings: false"
        )
    if method == "lora" and strategy == "ep" and lora_router == "adapter":
        problems.append(
            "config keys 'train.lora.router': adapter and 'parallel.strategy': ep do not combine: peft's wrapper would "
            "move the router out of the names transformers' expert-parallel plan reads. Use train.lora.router: "
            "frozen or trainable, or parallel.strategy: fsdp"
        )
    if method == "lora" and strategy == "ep" and set(lora_targets) == {"routed_experts"}:
        problems.append(
            "config keys 'train.lora.targets': [routed_experts] and 'parallel.strategy': ep do not combine: under "
            "expert parallelism the experts' adapters go beside peft's, which need a module to adapt too. Add "
            "attention to train.lora.targets, or use parallel.strategy: fsdp"
        )
    if method == "lora" and strategy == "fsdp" and world > 1 and not fsdp2:
        problems.append(
            "config keys 'train.method': lora and 'parallel.strategy': fsdp do not combine on torch "
            f"{compat.version_of('torch')}: FSDP1 flattens a unit's parameters into one tensor of one dtype, and "
            "a LoRA unit holds a frozen base and fp32 adapters. Use STACK=current (FSDP2 shards each parameter), "
            "or parallel.strategy: none (every rank holds the frozen base and the adapters)"
        )
    if method == "esft" and strategy == "fsdp" and not fsdp2 and registry.experts_fused(model_type):
        problems.append(
            f"config keys 'train.method': esft and 'parallel.strategy': fsdp do not combine for {model_type}'s fused "
            f"expert tensors on torch {compat.version_of('torch')}: FSDP1's flat shards split elements, not experts, "
            "so the unselected experts' rows cannot be masked. Use parallel.strategy: none, or STACK=current (FSDP2)"
        )
    if cpu_offload:
        problems += _offload_problems(strategy, fsdp2)
    return problems


def _offload_problems(strategy: str, fsdp2: bool) -> list[str]:
    from moeflow.runtime import compat

    if strategy == "none":
        return [
            "config key 'parallel.cpu_offload': true needs parallel.strategy: fsdp (FSDP2's offload policy holds "
            "the sharded parameters, gradients and optimizer state on the host and streams each layer in); with "
            "one rank, fsdp shards over a group of one. Set parallel.strategy: fsdp, or cpu_offload: false"
        ]
    if strategy == "ep":
        return [
            "config keys 'parallel.cpu_offload': true and 'parallel.strategy': ep do not combine: under ep "
            "transformers makes the FSDP units, and moeflow does not turn its offload on (untested). Use "
            "parallel.strategy: fsdp"
        ]
    if not fsdp2:
        return [
            f"config key 'parallel.cpu_offload': true needs FSDP2's offload policy, and torch "
            f"{compat.version_of('torch')} runs FSDP1 here. Use STACK=current, or cpu_offload: false"
        ]
    return []
