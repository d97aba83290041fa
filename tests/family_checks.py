"""The family conformance checks, shared by tests/unit/test_families.py and tools/family_table.py.

Each check takes a family (``tiny_models.FAMILIES``) and passes, fails with an AssertionError, or is refused
by the code with a clear error (``run_check`` turns that into the reason recorded in docs/families.md).
"""

from __future__ import annotations

import tempfile

import torch
import torch.nn.functional as F
from tiny_models import (
    FAMILY_CONFIGS,
    MOE_LAYERS,
    SEQ,
    VOCAB,
    build_family,
    model_config,
    spread_routers,
)

from moeflow.data.collate import collate, model_inputs
from moeflow.families import registry
from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.loading.factory import make_model
from moeflow.model import parameters as P
from moeflow.model.chunked_loss import next_token_targets
from moeflow.model.routing import SIGMOID, UnsupportedModel, adapter_for, capture
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.settings import BalanceSettings, TrainSettings
from moeflow.train.trainer import Trainer, accumulate_gradients
from moeflow.workflow.keys import training

COEF = 0.05
DOCUMENTS = [[12, 20], [5, 27], [9, 7, 4]]  # document lengths per packed row; the last row is shorter: padding
SHARED_EXPERTS = ("qwen2_moe", "deepseek_v3", "step3p5")
EXPERT_BIASES = ("gpt_oss",)
REFUSALS = (compat.UnsupportedOnStack, UnsupportedModel)


def stack() -> str:
    return "current" if compat.is_transformers_v5() else "pinned"


def dtype_for(model_type: str) -> torch.dtype:
    """float64, except where the model does not run in float64: transformers 4.57's DeepSeek-V3 routes in
    float32 and adds its experts' outputs into a float32 buffer."""
    return torch.float32 if model_type == "deepseek_v3" and not compat.is_transformers_v5() else torch.float64


def tolerance(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float64 else 1e-4


def build(model_type: str, attn: str = "eager", seed: int = 0):
    """The family's tiny model; a family the stack lacks, or an attention implementation the model does not
    take, is refused (moeflow.families names the stack; transformers raises a ValueError naming the
    implementation)."""
    try:
        return build_family(model_type, attn, dtype_for(model_type), seed)
    except ValueError as exc:
        if "does not support an attention implementation" in str(exc):
            raise compat.UnsupportedOnStack(str(exc).split(". ")[0]) from None
        raise


def causal_lm_config(model_type: str) -> dict:
    """The model config of a family's tiny causal LM (what moeflow trains); refused on a stack without it."""
    registry.require_stack(model_type)
    return model_config(model_type)


def forward(model, inputs) -> torch.Tensor:
    out = model(**inputs, use_cache=False)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def packed_rows(seed: int = 1) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for doc, lengths in enumerate(DOCUMENTS):
        ids = torch.randint(3, VOCAB, (sum(lengths),), generator=generator).tolist()
        labels = list(ids)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        for start in starts:
            labels[start] = -100
        rows.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": [p for n in lengths for p in range(n)],
                "doc_ids": [10 * doc + i for i, n in enumerate(lengths) for _ in range(n)],
            }
        )
    return rows


# --------------------------------------------------------------------------- packing


def check_packing(model_type: str, attn: str) -> None:
    """Each packed document's outputs equal the document run alone."""
    model = build(model_type, attn)
    rows = packed_rows()
    with torch.no_grad():
        packed = forward(model, model_inputs(model, collate(rows)))
        worst = 0.0
        for r, lengths in enumerate(DOCUMENTS):
            start = 0
            for n in lengths:
                alone = forward(model, {"input_ids": torch.tensor([rows[r]["input_ids"][start : start + n]])})[0]
                worst = max(worst, float((packed[r, start : start + n] - alone).abs().max()))
                start += n
    assert worst < tolerance(dtype_for(model_type)), f"{model_type} {attn}: packed vs alone max |diff| {worst:.3g}"


# --------------------------------------------------------------------------- routing


def reference_routing(model_type: str, site, hidden: torch.Tensor):
    """logits = h @ W^T (+ b), then the family's selection rule, from the router's parameters and the config."""
    config, router, k = FAMILY_CONFIGS[model_type], site.router, site.top_k
    h = hidden.reshape(-1, hidden.shape[-1])
    dtype = torch.promote_types(h.dtype, torch.float32)
    h = h.to(dtype)
    logits = h @ site.weight.to(dtype).T
    if model_type == "gpt_oss":
        logits = logits + router.bias.to(dtype)
    if model_type in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe"):
        weight, index = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        if config.get("norm_topk_prob", True):  # mixtral always renormalises
            weight = weight / weight.sum(-1, keepdim=True)
    elif model_type in ("gpt_oss", "granitemoe"):
        top, index = logits.topk(k, dim=-1)
        weight = torch.softmax(top, dim=-1)
    elif model_type in ("deepseek_v3", "step3p5"):
        scores = torch.sigmoid(logits)
        biased = scores + router.e_score_correction_bias.to(dtype)
        groups = config.get("n_group", 1)
        if groups > 1:  # keep the topk_group groups with the largest sum of their two best biased scores
            grouped = biased.view(len(h), groups, -1)
            keep = grouped.topk(2, dim=-1).values.sum(-1).topk(config["topk_group"], dim=-1).indices
            allowed = torch.zeros(len(h), groups, dtype=torch.bool).scatter_(1, keep, True)
            biased = biased.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        index = biased.topk(k, dim=-1).indices
        weight = scores.gather(1, index)
        scale = config.get("routed_scaling_factor", config.get("moe_router_scaling_factor", 1.0))
        weight = weight / weight.sum(-1, keepdim=True) * scale
    else:
        raise AssertionError(model_type)
    return logits, index, weight


def sorted_by_expert(index: torch.Tensor, weight: torch.Tensor):
    order = index.argsort(dim=-1)
    return index.gather(1, order), weight.double().gather(1, order)


def check_routing(model_type: str) -> dict:
    """Captured routing equals the hand reference on every MoE layer; returns what the choice depended on
    (``differs_from_plain_topk``, ``differs_without_groups``) for the tests to assert on."""
    model = build(model_type)
    adapter = adapter_for(model)
    router_inputs = {}
    handles = [
        site.router.register_forward_pre_hook(lambda m, args, key=site.layer: router_inputs.__setitem__(key, args[0]))
        for site in adapter.sites
    ]
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad(), capture(model) as routing:
            out = model(input_ids=input_ids, use_cache=False, output_router_logits=True)
    finally:
        for handle in handles:
            handle.remove()
    layers, tokens = routing.layers, input_ids.numel()
    assert [r.layer for r in layers] == MOE_LAYERS.get(model_type, [0, 1])
    found = {"differs_from_plain_topk": False, "differs_without_groups": False}
    for site, record in zip(adapter.sites, layers):
        assert record.num_experts == 8 and record.topk_index.dtype == torch.int64
        assert record.logits.shape == (tokens, 8) and record.topk_index.shape == (tokens, 2)
        logits, index, weight = reference_routing(model_type, site, router_inputs[site.layer])
        torch.testing.assert_close(record.logits.to(logits.dtype), logits, rtol=1e-5, atol=1e-5)
        got_index, got_weight = sorted_by_expert(record.topk_index, record.topk_weight)
        want_index, want_weight = sorted_by_expert(index, weight)
        assert torch.equal(got_index, want_index), f"{model_type} layer {site.layer}: chosen experts differ"
        torch.testing.assert_close(got_weight, want_weight, rtol=1e-5, atol=1e-5)
        probs = record.probs()
        assert probs.dtype == torch.promote_types(record.logits.dtype, torch.float32)
        scores = torch.sigmoid(logits)
        want = scores / scores.sum(-1, keepdim=True) if record.scoring == SIGMOID else torch.softmax(logits, -1)
        torch.testing.assert_close(probs, want.to(probs.dtype))
        plain = sorted_by_expert(logits.topk(2, dim=-1).indices, weight)[0]
        found["differs_from_plain_topk"] |= not torch.equal(plain, want_index)
        bias = getattr(site.router, "e_score_correction_bias", None)
        if bias is not None:
            ungrouped = (torch.sigmoid(logits) + bias.to(logits.dtype)).topk(2, dim=-1).indices
            ungrouped = sorted_by_expert(ungrouped, weight)[0]
            found["differs_without_groups"] |= not torch.equal(ungrouped, want_index)
    returned = getattr(out, "router_logits", None)
    if returned:  # the public API's logits, where the model returns them, are the ones captured
        assert len(returned) == len(layers)
        for got, record in zip(returned, layers):
            got = got.reshape(tokens, -1).to(record.logits.dtype)
            if model_type == "gpt_oss" and not compat.is_transformers_v5():
                # 4.57's GPT-OSS "router_logits" are its routing scores: softmax over the chosen logits.
                want = torch.zeros_like(got).scatter_(1, record.topk_index, record.topk_weight.to(got.dtype))
                torch.testing.assert_close(got, want)
            else:
                torch.testing.assert_close(got, record.logits)
    return found


# --------------------------------------------------------------------------- gradients


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def full_batch_grads(model, batch) -> torch.Tensor:
    """One forward over the whole batch: mean CE over its label tokens plus the balancing loss
    N_E * sum_i f_i P_i (f: the batch's top-k shares, P: mean probabilities over real tokens), per layer."""
    model.zero_grad(set_to_none=True)
    with capture(model) as routing:
        logits = forward(model, model_inputs(model, batch))
        targets = next_token_targets(batch["labels"]).reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=-100)
        real = (batch["doc_ids"] >= 0).reshape(-1)
        per_layer = []
        for record in routing.layers:
            probs, chosen = record.probs()[real], record.topk_index[real]
            f = torch.bincount(chosen.reshape(-1), minlength=record.num_experts).to(probs.dtype) / chosen.numel()
            per_layer.append(record.num_experts * (f * probs.mean(0)).sum())
        (loss + COEF * torch.stack(per_layer).mean()).backward()
    return grads(model)


def check_accumulation(model_type: str) -> None:
    """Micro-batches accumulated with ``exact`` balancing give the full batch's gradient."""
    model = make_model(typed(ModelSettings, causal_lm_config(model_type)), vocab_size=VOCAB, seed=0).to(
        dtype_for(model_type)
    )
    spread_routers(model)
    rows = packed_rows()[:2] * 2
    reference = full_batch_grads(model, collate(rows))
    model.zero_grad(set_to_none=True)
    exact = typed(BalanceSettings, {"mode": "exact", "coef": COEF})
    accumulate_gradients(model, [collate(rows[:2]), collate(rows[2:])], exact, adapter_for(model))
    accumulated = grads(model)
    gap = float((accumulated - reference).norm() / reference.norm())
    assert gap < tolerance(dtype_for(model_type)), f"{model_type}: accumulated vs full batch relative gap {gap:.3g}"


# --------------------------------------------------------------------------- parameter categories


def check_parameter_categories(model_type: str) -> None:
    """Every parameter has a category; the routers are exactly the routing adapter's, routed experts sit in
    MoE layers only, and the family's shared experts, expert biases and norms are found."""
    model = build(model_type)
    adapter = adapter_for(model)
    names = dict(model.named_parameters())
    found = {name: P.category(name) for name in names}
    assert None not in found.values(), f"uncategorised: {[n for n, c in found.items() if c is None]}"
    mtp = mtp_prefixes(model)  # MTP layers: named as decoder layers, carried frozen, never routed
    assert all(not p.requires_grad for n, p in names.items() if is_mtp_name(n, mtp))
    routers = {n for n, c in found.items() if c == P.ROUTER and not is_mtp_name(n, mtp)}
    router_ids = {id(p) for site in adapter.sites for p in site.router.parameters()}
    router_params = {name for name, p in names.items() if id(p) in router_ids}
    assert routers == router_params, f"router category {sorted(routers)}, the adapter's routers {sorted(router_params)}"
    experts = {n for n, c in found.items() if c in (P.ROUTED_EXPERTS, P.EXPERT_BIASES) and not is_mtp_name(n, mtp)}
    assert experts and {P.layer_index(n) for n in experts} == set(adapter.moe_layers)
    assert any(c == P.NORMS for c in found.values())
    assert any(c == P.SHARED_EXPERTS for c in found.values()) == (model_type in SHARED_EXPERTS)
    assert any(c == P.EXPERT_BIASES for c in found.values()) == (model_type in EXPERT_BIASES)
    biases = [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]
    biases += [n for n in names if n.endswith("e_score_correction_bias")]
    assert all(P.category(n) == P.CORRECTION_BIAS for n in biases)


# --------------------------------------------------------------------------- training and saving


def check_train_and_reload(model_type: str) -> None:
    """Two training steps, then save_pretrained and moeflow's make_model (loading the folder) give the same outputs."""
    model_cfg = causal_lm_config(model_type)
    dtype = dtype_for(model_type)
    model = make_model(typed(ModelSettings, model_cfg), vocab_size=VOCAB, seed=0).to(dtype)
    spread_routers(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = typed(
        TrainSettings,
        training(
            {
                "steps": 2,
                "lr": 1e-3,
                "warmup_steps": 1,
                "micro_batch_size": 2,
                "grad_accum_steps": 1,
                "balance": {"mode": "running", "coef": 0.01},
                "routing_guard": {"window_steps": 100},
                "memory_guard": {"skip_steps": 100},
            }
        ),
    )
    trainer = Trainer(model, settings, packed_rows()[:2] * 2, collate_fn=collate, seed=0)
    trainer.run()
    assert [r["step"] for r in trainer.train_records()] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer.train_records())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    batch = collate(packed_rows())
    model.eval()
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        model.save_pretrained(folder, safe_serialization=True)
        reloaded = make_model(typed(ModelSettings, model_cfg), folder=folder, dtype=dtype).eval()
        assert reloaded.config.tie_word_embeddings == model.config.tie_word_embeddings
        again = forward(reloaded, model_inputs(reloaded, batch))
        torch.testing.assert_close(again, forward(model, model_inputs(model, batch)), rtol=0, atol=0)


CHECKS = {
    "packing (eager)": lambda family: check_packing(family, "eager"),
    "packing (sdpa)": lambda family: check_packing(family, "sdpa"),
    "routing": check_routing,
    "exact accumulation": check_accumulation,
    "parameter categories": check_parameter_categories,
    "train + reload": check_train_and_reload,
}


def run_check(check: str, family: str) -> tuple[str, str]:
    """("pass", "") or ("refused", the code's reason); a failing check raises."""
    try:
        CHECKS[check](family)
    except REFUSALS as exc:
        return "refused", " ".join(str(exc).split())
    return "pass", ""


# --------------------------------------------------------------------------- the table (docs/families.md)

STACKS = ("pinned", "current")
TABLE_HEADER = "| family | check | pinned | current |"


def cell(result: tuple[str, str]) -> str:
    status, reason = result
    return status if not reason else f"{status}: {reason.replace('|', '/')}"


def read_table(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """{(family, check): {stack: cell}} from the table of docs/families.md."""
    lines = text.splitlines()
    start = lines.index(TABLE_HEADER) + 2
    table = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        family, check, *cells = [part.strip() for part in line.strip("|").split(" | ")]
        table[(family.strip("`"), check)] = dict(zip(STACKS, cells))
    return table


def render_table(table: dict[tuple[str, str], dict[str, str]], intro: str) -> str:
    rows = [
        f"| `{family}` | {check} | " + " | ".join(table[(family, check)].get(s, "not run") for s in STACKS) + " |"
        for family, check in table
    ]
    return intro + "\n" + TABLE_HEADER + "\n|---|---|---|---|\n" + "\n".join(rows) + "\n"


README_START, README_END = "<!-- families:start -->", "<!-- families:end -->"


def summary_table(table: dict[tuple[str, str], dict[str, str]]) -> str:
    """The README's family x stack summary of the matrix: which checks pass, which are refused (details in
    docs/families.md)."""
    families = list(dict.fromkeys(family for family, _ in table))
    lines = ["| family | " + " | ".join(STACKS) + " |", "|---|" + "---|" * len(STACKS)]
    for family in families:
        cells = []
        for stack in STACKS:
            results = {check: table[(family, check)].get(stack, "not run") for f, check in table if f == family}
            passed = [c for c, r in results.items() if r == "pass"]
            other = [c for c, r in results.items() if r != "pass"]
            if not other:
                cells.append(f"all {len(passed)} checks pass")
            elif not passed:
                cells.append("refused" if all(results[c].startswith("refused") for c in other) else "fails")
            else:
                verdict = "refused" if all(results[c].startswith("refused") for c in other) else "fails"
                cells.append(f"{len(passed)} pass; {verdict}: {', '.join(other)}")
        lines.append(f"| `{family}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_summary(readme: str, table: dict[tuple[str, str], dict[str, str]]) -> str:
    """``readme`` with the block between the family markers replaced by :func:`summary_table`."""
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_START}\n{summary_table(table)}\n{README_END}{tail}"
