"""The fixed cost of a stage job (docs/benchmarks.md, "Fixed cost per job"): a stage that does not use torch does
not import it, and what a stage records is the same whether or not it did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from moeflow.settings import SCHEMA_PATH, schema


def run_python(code: str) -> dict:
    """``code`` in a fresh interpreter of this stack (this process has torch imported already); its last
    printed line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_stage_without_torch_records_the_same_provenance_without_importing_it():
    got = run_python(
        "import json, sys\n"
        "from moeflow.runtime.stage import Stage\n"
        "provenance = Stage(name='s', threads=2).provenance()\n"
        "imported = 'torch' in sys.modules\n"
        "import torch\n"
        "print(json.dumps({'imported': imported, 'provenance': provenance, 'torch': torch.__version__}))"
    )
    assert not got["imported"], "Stage imported torch"
    assert got["provenance"]["torch"] == got["torch"]  # the local tag too (2.3.1+cu121), unlike the metadata's
    assert got["provenance"]["threads"] == 2


def test_a_stage_sets_torch_threads_whenever_torch_is_imported():
    got = run_python(
        "import json, torch\n"
        "from moeflow.runtime.stage import Stage\n"
        "started = Stage(name='s', threads=3)\n"
        "at_start = torch.get_num_threads()\n"
        "torch.set_num_threads(1)\n"  # as though torch were imported after the stage started
        "provenance = started.provenance()\n"
        "print(json.dumps({'at_start': at_start, 'recorded': provenance['threads'], 'now': torch.get_num_threads()}))"
    )
    assert got == {"at_start": 3, "recorded": 3, "now": 3}


def test_the_stages_that_need_no_torch_do_not_import_it():
    """humaneval_execute and paper: their scripts' modules and their stage start leave torch (and transformers)
    out; the other stages import it through transformers, which imports torch itself."""
    got = run_python(
        "import json, sys\n"
        "import moeflow.evaluation.humaneval, moeflow.evaluation.humaneval_execution, moeflow.evaluation.sandbox\n"
        "import moeflow.paper.build, moeflow.paper.eval_results, moeflow.paper.inputs, moeflow.runtime.files\n"
        "from moeflow.runtime.stage import Stage\n"
        "Stage(name='paper').provenance()\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    assert got == []


def test_the_schema_reads_the_same_with_the_fast_loader():
    assert schema() == yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def test_transformers_does_not_import_scikit_learn_in_a_moeflow_process():
    """transformers 4.57's generation code imports scikit-learn at import for an option moeflow never uses
    (moeflow.runtime.compat.skip_transformers_sklearn_import); lm-eval still imports it where a metric needs it."""
    got = run_python(
        "import json, sys\n"
        "import moeflow.model.configs\n"
        "import transformers.generation.utils, transformers.modeling_utils\n"
        "before = 'sklearn' in sys.modules\n"
        "import sklearn.metrics\n"
        "print(json.dumps({'before': before, 'after': 'sklearn.metrics' in sys.modules}))"
    )
    assert got == {"before": False, "after": True}
