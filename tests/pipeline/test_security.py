"""Security: no code from a model folder runs unless the config trusts that model, nothing is unpickled,
nothing reaches the network, and the config cannot make a stage write outside results/<stack>/."""

from __future__ import annotations

import ast
import errno
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import (  # noqa: E402
    NOT_REPRODUCED,  # noqa: E402
    active_stack,
    copy_workflow,
    snakemake,
)
from tiny_models import folder_settings, tiny_model_cfg  # noqa: E402

from moeflow.loading.factory import make_model  # noqa: E402
from moeflow.model.folder import ModelError, load_tokenizer  # noqa: E402
from moeflow.model.settings import ModelSettings
from moeflow.runtime import env  # noqa: E402
from moeflow.runtime.stage import OFFLINE_ENV, Stage  # noqa: E402
from moeflow.settings import REPO_ROOT, ConfigError, typed
from moeflow.workflow.load import load, run_config
from moeflow.workflow.merge import run_names

SMOKE = REPO_ROOT / "config" / "smoke.yaml"
MARKER = "PAYLOAD_RAN"


class Payload:
    """Unpickling this runs code: it writes a marker file (what an attacker's checkpoint would do worse)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def pickle_payload(path: Path) -> Path:
    """A torch.save file (.bin/.pt) whose unpickling runs code."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "extra": Payload(path.parent / MARKER)}, path)
    return path


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "tiny"
    make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=97, seed=0).save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- trust_remote_code


def test_trust_remote_code_is_off_unless_turned_on_for_a_named_model(tmp_path):
    for cfg in (load(), load(SMOKE)):
        assert all(not run_config(cfg, run)["model"]["trust_remote_code"] for run in run_names(cfg))
    with pytest.raises(ConfigError) as err:
        load(SMOKE, overrides={"model": {"trust_remote_code": True}})
    assert str(err.value) == (
        "invalid configuration: config key 'model.trust_remote_code' is on but 'model.pretrained' is not set: it may "
        "only be turned on for a named model folder whose code you trust"
    )
    trusted = load(
        SMOKE, overrides={"runs": {"remote": {"model": {"pretrained": str(tmp_path), "trust_remote_code": True}}}}
    )
    assert run_config(trusted, "remote")["model"]["trust_remote_code"]


def test_the_verification_report_says_when_trust_remote_code_is_on():
    report = env.collect(
        active_stack(),
        REPO_ROOT / "envs" / f"{active_stack()}.yaml",
        trust_remote_code={"moe": False, "remote": True},
    )
    assert report["trust_remote_code"] == {"moe": False, "remote": True}
    assert "run(s) remote set model.trust_remote_code: they execute code from the model folder" in env.enforce(
        report, strict=False
    )
    markdown = env.render_markdown(report)
    assert "## trust_remote_code per run" in markdown and "- `remote`: yes" in markdown and "- `moe`: no" in markdown


def custom_code_folder(folder: Path) -> Path:
    """A model folder whose config.json points at Python in the folder (auto_map), as hub models with custom
    code do; importing that Python writes a marker."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "custom_moe",
                "architectures": ["CustomMoe"],
                "auto_map": {
                    "AutoConfig": "custom.CustomConfig",
                    "AutoModelForCausalLM": "custom.CustomMoe",
                    "AutoTokenizer": ["custom.CustomTokenizer", None],
                },
            }
        )
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}})
    )
    (folder / "custom.py").write_text(f"open(__file__.replace('custom.py', {MARKER!r}), 'w').write('ran')\n")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_code_in_a_model_folder_does_not_run_without_trust_remote_code(tmp_path):
    folder = custom_code_folder(tmp_path / "custom")
    expected = (
        f"model folder {folder} needs custom code from the folder (config.json auto_map) and model.trust_remote_code "
        "is off: moeflow does not run a model's own Python unless the config says so for that model. If you trust it, "
        "set model.trust_remote_code: true next to model.pretrained (the verification report records it)"
    )
    with pytest.raises(ModelError) as err:
        make_model(folder_settings(trust_remote_code=False), folder=folder)
    assert str(err.value) == expected
    with pytest.raises(ModelError) as err:
        load_tokenizer(folder)
    assert str(err.value) == expected
    assert not (folder / MARKER).exists()


# --------------------------------------------------------------------------- pickles


def _torch_load_calls(path: Path) -> list[tuple[str, int, bool]]:
    """Every ``torch.load(...)`` call in a Python file, and whether it passes ``weights_only=True``."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            calls.append((path.name, node.lineno, safe))
    return calls


def test_every_torch_load_in_the_pipeline_uses_weights_only(tmp_path):
    probe = tmp_path / "probe.py"  # the checker tells a safe call from an unsafe one
    probe.write_text(
        "import torch\ntorch.load(p)\ntorch.load(p, weights_only=True)\ntorch.load(p, weights_only=False)\n"
    )
    assert _torch_load_calls(probe) == [("probe.py", 2, False), ("probe.py", 3, True), ("probe.py", 4, False)]
    files = [*(REPO_ROOT / "src").rglob("*.py"), *(REPO_ROOT / "workflow").rglob("*.py")]
    assert len(files) > 20
    assert [call for path in files for call in _torch_load_calls(path) if not call[2]] == []


def test_weights_only_loading_refuses_a_pickle_payload(tmp_path):
    payload = pickle_payload(tmp_path / "weights.pt")
    with pytest.raises(pickle.UnpicklingError, match="exec"):
        torch.load(payload, weights_only=True)
    assert not (tmp_path / MARKER).exists()


def test_a_model_folder_with_pickle_weights_is_refused(saved_model, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_bytes((saved_model / "config.json").read_bytes())
    pickle_payload(folder / "pytorch_model.bin")
    with pytest.raises(ModelError) as err:
        make_model(typed(ModelSettings, tiny_model_cfg()), folder=folder)
    assert str(err.value) == (
        f"model folder {folder} has no safetensors weights: it holds pickle weights (pytorch_model.bin), which moeflow "
        "refuses to load because unpickling can run code. Convert the model to safetensors "
        "(save_pretrained(..., safe_serialization=True)) from a source you trust"
    )
    assert not (folder / MARKER).exists()
    # beside safetensors weights a pickle is ignored, never read
    (folder / "model.safetensors").write_bytes((saved_model / "model.safetensors").read_bytes())
    model = make_model(typed(ModelSettings, tiny_model_cfg()), folder=folder)
    assert torch.equal(
        model.get_input_embeddings().weight,
        make_model(typed(ModelSettings, tiny_model_cfg()), folder=saved_model).get_input_embeddings().weight,
    )
    assert not (folder / MARKER).exists()


def test_a_training_checkpoint_with_a_pickle_instead_of_safetensors_is_refused(tmp_path):
    from tiny_training import make_trainer

    trainer = make_trainer()
    trainer.run(until=1)
    trainer.save(tmp_path / "step-00000001")
    checkpoint = tmp_path / "step-00000001"
    (checkpoint / "shard-0.safetensors").unlink()
    pickle_payload(checkpoint / "shard-0.bin")
    pickle_payload(checkpoint / "metadata.pt").rename(checkpoint / ".metadata")  # DCP's FileSystemReader unpickles it
    with pytest.raises(FileNotFoundError) as err:
        make_trainer().load(checkpoint)
    assert str(err.value) == (
        f"checkpoint {checkpoint} lacks shard-0.safetensors: moeflow reads checkpoints as safetensors plus JSON only "
        "(pickle files are never loaded: unpickling can run code). Delete the folder to start the stage afresh"
    )
    assert not (checkpoint / MARKER).exists()


@pytest.mark.pipeline
@pytest.mark.fast
def test_the_pipeline_writes_weights_as_safetensors_only(smoke_pipeline):
    from moeflow.model.folder import PICKLE_WEIGHTS

    results = smoke_pipeline / "results" / active_stack()
    pickles = [p for pattern in PICKLE_WEIGHTS for p in results.rglob(pattern)]
    assert pickles == []
    weights = {p.parent.relative_to(results).parts[0] for p in results.rglob("*.safetensors")}
    assert {"base", "warmup", "runs"} <= weights  # the base model, the warmup checkpoint, the fine-tuned models


# --------------------------------------------------------------------------- the network


def test_stages_set_the_offline_variables(monkeypatch):
    for name in OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
    Stage(name="probe")
    assert {name: os.environ.get(name) for name in OFFLINE_ENV} == OFFLINE_ENV


@pytest.fixture
def no_network(monkeypatch):
    """Every connection or name lookup beyond this machine fails, and is recorded."""
    attempts: list[str] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(f"connect {address}")
            raise OSError(errno.ENETUNREACH, "network is unreachable (test)")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in (None, "127.0.0.1", "::1", "localhost"):
            attempts.append(f"resolve {host}")
            raise socket.gaierror(socket.EAI_NONAME, "name resolution disabled (test)")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def test_loading_models_and_tokenizers_never_reaches_the_network(saved_model, tmp_path, no_network):
    from moeflow.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    tokenizer.save_pretrained(saved_model)
    model = make_model(typed(ModelSettings, tiny_model_cfg()), folder=saved_model)
    tok = load_tokenizer(saved_model)
    assert tok("return x")["input_ids"] == tokenizer("return x")["input_ids"]
    assert model.config.model_type == "qwen3_moe"
    assert no_network == []


SITECUSTOMIZE = """
    import errno, os, socket
    _log, _connect, _getaddrinfo = os.environ["MOEFLOW_NETWORK_LOG"], socket.socket.connect, socket.getaddrinfo
    _LOCAL = (None, "127.0.0.1", "::1", "localhost")

    def _record(what):
        with open(_log, "a") as fh:
            fh.write(f"{os.getpid()} {what}\\n")

    def _connect_guard(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
            _record(f"connect {address}")
            raise OSError(errno.ENETUNREACH, "network is unreachable (test)")
        return _connect(self, address)

    def _getaddrinfo_guard(host, *args, **kwargs):
        if host not in _LOCAL:
            _record(f"resolve {host}")
            raise socket.gaierror(socket.EAI_NONAME, "name resolution disabled (test)")
        return _getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.getaddrinfo = _connect_guard, _getaddrinfo_guard
    with open(_log, "a") as fh:
        fh.write("")
"""


@pytest.mark.pipeline
def test_stages_without_network_give_the_same_outputs(pipeline_copy, tmp_path):
    """verify_env, coverage (loads the base model) and warmup (loads it, trains) rerun in processes where any
    connection beyond localhost fails and is logged, without the HF offline variables in the environment and
    with proxies and the hub pointed at a dead port: same outputs, and no process tried the network."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    attempts = tmp_path / "network.log"
    results = pipeline_copy / "results" / active_stack()
    outputs = [results / "env", next((results / "coverage").glob("c-*")), next((results / "warmup").glob("w-*"))]
    before = {out: _files(out) for out in outputs}

    run_env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    dead = "http://127.0.0.1:9"
    run_env |= {
        "STACK": active_stack(),
        "MOEFLOW_NETWORK_LOG": str(attempts),
        "HF_ENDPOINT": dead,
        "HTTP_PROXY": dead,
        "HTTPS_PROXY": dead,
        "http_proxy": dead,
        "https_proxy": dead,
        "PYTHONPATH": os.pathsep.join([str(guard), str(pipeline_copy / "src"), run_env.get("PYTHONPATH", "")]),
    }
    targets = [
        str(results.relative_to(pipeline_copy) / "env" / "report.json"),
        str(outputs[1].relative_to(pipeline_copy) / "coverage.json"),
        str(outputs[2].relative_to(pipeline_copy)),
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            *targets,
            "--cores",
            "2",
            "--configfile",
            "config/smoke.yaml",
            "--forcerun",
            "verify_env",
            "coverage_valset",
            "warmup",
        ],
        cwd=pipeline_copy,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert attempts.exists(), "the guard was not loaded"  # sitecustomize created the log in every process
    assert attempts.read_text() == ""
    log = proc.stdout + proc.stderr
    assert all(f"rule {rule}:" in log for rule in ("verify_env", "coverage_valset", "warmup"))
    report = json.loads((results / "env" / "report.json").read_text())
    assert report["trust_remote_code"] == {}  # only runs that turn it on are listed: the smoke config trusts none
    for out in outputs:
        after = _files(out)
        assert after.keys() == before[out].keys()
        assert [name for name in after if name not in NOT_REPRODUCED and after[name] != before[out][name]] == [], out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- paths


def test_a_corpus_name_cannot_lead_outside_the_results_folder():
    with pytest.raises(ConfigError) as err:
        load(SMOKE, overrides={"data": {"sources": {"../../outside": {"type": "stdlib", "packages": ["json"]}}}})
    assert str(err.value) == (
        "invalid configuration: config key 'data.sources.../../outside': corpus names may use letters, digits, '_', "
        "'.', '-' only (the name is a folder under results/)"
    )
    with pytest.raises(ConfigError, match="config key 'runs.../x': run names may use letters, digits"):
        load(SMOKE, overrides={"runs": {"../x": {}}})


def test_every_output_and_log_of_the_workflow_lies_under_the_results_folder(tmp_path):
    """Snakemake's own list of every file the smoke workflow writes (outputs and logs), with corpora and
    runs named as a user may name them."""
    workdir = copy_workflow(tmp_path / "moeflow")
    (workdir / "config" / "names.yaml").write_text(
        "data: {sources: {my.corpus-1: {type: stdlib, packages: [json]}}, eval_corpora: [my.corpus-1]}\n"
        "runs: {run_2.b: {train: {lr: 1.0e-4}}}\n"
    )
    proc = snakemake(workdir, "paper", "--configfile", "config/smoke.yaml", "config/names.yaml", "--summary")
    rows = [line.split("\t") for line in proc.stdout.splitlines() if "\t" in line][1:]
    written = [row[0] for row in rows] + [log for row in rows for log in row[3].split(",") if log not in ("-", "")]
    assert (
        len(rows) > 30 and any("my.corpus-1" in path for path in written) and any("run_2.b" in path for path in written)
    )
    results = (workdir / "results" / active_stack()).resolve()
    outside = [path for path in written if not (workdir / path).resolve().is_relative_to(results)]
    assert outside == []
