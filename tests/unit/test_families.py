"""The family conformance matrix: every supported MoE family x check on this stack, pass or refused by the
code with a clear error, exactly as docs/families.md (written by tools/family_table.py) says."""

from __future__ import annotations

from pathlib import Path

import family_checks as C
import pytest
from tiny_models import FAMILIES, VOCAB, model_config

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "families.md"


@pytest.fixture(scope="module")
def committed():
    return C.read_table(TABLE.read_text())


def test_the_table_covers_every_family_and_check(committed):
    assert list(committed) == [(f, c) for f in FAMILIES for c in C.CHECKS]
    assert all(set(cells) == set(C.STACKS) for cells in committed.values())


@pytest.mark.parametrize("check", list(C.CHECKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_check(family, check, committed):
    result = C.cell(C.run_check(check, family))  # a failing check raises here
    assert result == committed[(family, check)][C.stack()], "docs/families.md is out of date: run tools/family_table.py"


def test_the_readme_summary_is_the_tables(committed):
    readme = (ROOT / "README.md").read_text()
    assert C.README_START in readme and C.README_END in readme
    assert C.with_summary(readme, committed) == readme, (
        "the README's family table is out of date: run tools/family_table.py"
    )


def test_deepseek_v3_routes_in_float32_under_bf16_autocast():
    """#36 item 7: DeepSeek-V3's published router computes in float32; transformers' F.linear on float32 tensors
    ran in bf16 under the Trainer's autocast. Under autocast the router's output is exactly its float32
    computation without autocast (both stacks: 5 returns logits, weights and index; 4.57 index and weights)."""
    import torch

    from moeflow.model.factory import make_model
    from moeflow.model.families.deepseek_v3 import DeepseekV3Router
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    model = make_model(typed(ModelSettings, model_config("deepseek_v3")), vocab_size=VOCAB, seed=0)
    routers = [m for m in model.modules() if isinstance(m, DeepseekV3Router)]
    assert routers and all(r.weight.dtype == torch.float32 for r in routers)
    router = routers[0]
    hidden = torch.randn(12, router.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        want = router(hidden.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = router(hidden)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)
    # and the routing capture's logits (the z-loss's and balance loss's input) are the router's float32 ones
    from moeflow.model.routing import capture

    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), capture(model) as routing:
        model(input_ids=ids, use_cache=False)
    assert routing.layers and all(layer.logits.dtype == torch.float32 for layer in routing.layers)
