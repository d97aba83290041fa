"""The SLURM profiles against a real SLURM: Debian's 22.05 daemons, started and stopped by tests/slurm_cluster.py,
driven by snakemake-executor-plugin-slurm as it really submits.

- **This machine as a one-node cluster** (partitions ``cpu`` and ``gpu``), with a profile derived from
  profiles/slurm by overriding only what a 2-core node without GPUs lacks: the smoke pipeline's shards and
  base-model pretraining run through the plugin from the tokenizer and experts choice of the session's local
  smoke pipeline. The pretraining job is frozen after its first checkpoint, killed with ``scancel
  --signal=KILL`` and rerun with ``--rerun-incomplete``: it resumes from the checkpoint, and the shards, the
  weights and every logged loss equal the local run's.
- **Emulated GPU nodes** (one 8-GPU node for profiles/slurm, six for profiles/slurm-multinode): every rule's
  request, as Snakemake's dry run with the unmodified profile evaluates it and the installed plugin's own
  sbatch-line functions write it, is accepted by the real sbatch (``--test-only``). Running each job for real
  would need every upstream job to have run first; the train_model job does run, end to end: the plugin
  submits it (the same line the functions wrote), the jobstep runs the rule, and its srun starts torchrun,
  replaced by a recorder (tests/torchrun_recorder): one agent per node with the right ``--nnodes``,
  ``--nproc_per_node``, node, GPUs and rendezvous endpoint, read from the job's own output.

docs/scaling-out.md's sbatch lines are the ones these tests see.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import SMOKE, active_stack, copy_workflow, only_on, workflow_env
from slurm_cluster import Cluster, Unavailable

from moeflow.runtime.stage import KILL_ENV, KILL_SCOPE_ENV
from moeflow.settings import REPO_ROOT
from moeflow.workflow.keys import base_key, data_key, experts_key, tokenizer_key
from moeflow.workflow.load import load, run_config

# A real SLURM on one stack: its plugin (2.6.1) is the stricter one, and the other stack's (2.8.0) writes the same
# sbatch lines (test_docs_show_the_sbatch_lines_the_plugin_writes runs on both).
real_slurm = only_on("pinned", "the real-SLURM tests; the other stack's plugin writes the same sbatch lines")

PROFILES = REPO_ROOT / "profiles"
RECORDER = Path(__file__).resolve().parents[1] / "torchrun_recorder"
DOCS = REPO_ROOT / "docs" / "scaling-out.md"
# The first status check a second after a submission (the plugin's default: 40 s); the plugin then waits
# 10 s longer each time until a job ends.
FAST_STATUS = ("--slurm-init-seconds-before-status-checks", "1")
STEP_KILLED, CHECKPOINT_EVERY = 11, 10  # config/smoke.yaml: pretrain.checkpoint_every
TENSORBOARD = "training/tensorboard/"  # event files are named after the time and the process


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def snakemake_env(workdir: Path, cluster: Cluster, **extra: str) -> dict[str, str]:
    return workflow_env(workdir, **{**cluster.env, **extra})


def run_snakemake(workdir: Path, cluster: Cluster, *args: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir,
        env=snakemake_env(workdir, cluster, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started(cluster: Cluster) -> Cluster:
    """The cluster, started; where SLURM cannot run (not root, no apt-get) a skip, except in CI, whose
    machine runs them (as root, with Debian's registry)."""
    try:
        return cluster.start()
    except Unavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no SLURM here: {exc}")


def failure(proc) -> str:
    return f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


# --------------------------------------------------------------------------- this machine as one node


def local_profile(cluster: Cluster, dest: Path) -> Path:
    """profiles/slurm with only what this node lacks overridden: no GPUs (``gpu``, ``gpu_model`` dropped),
    its memory as the most ``mem_mb`` asks, its cores as the most ``set-threads`` asks. Partitions, time
    limits, nodes, tasks, ``--exclusive`` and the status command stay as shipped."""
    node = cluster.nodes[0]
    cfg = yaml.safe_load((PROFILES / "slurm" / "config.yaml").read_text())
    for res in (cfg["default-resources"], *cfg["set-resources"].values()):
        res.pop("gpu", None)
        res.pop("gpu_model", None)
        res["mem_mb"] = min(res["mem_mb"], node.memory_mb)
    cfg["set-threads"] = {rule: min(n, node.cpus) for rule, n in cfg["set-threads"].items()}
    dest.mkdir(parents=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def smoke_outputs(workdir: Path) -> dict[str, Path]:
    """The MoE run's outputs these tests compare, relative to the workflow folder."""
    cfg = run_config(load(workdir / "config" / "smoke.yaml"), "moe")
    results = Path("results") / active_stack()
    return {
        "tokenizer": results / "tokenizer" / tokenizer_key(cfg),
        "experts": results / "experts" / experts_key(cfg, "pretrain"),
        "shards": results / "data" / data_key(cfg) / cfg["data"]["base_corpus"],
        "base": results / "base" / base_key(cfg),
    }


@pytest.fixture(scope="module")
def pretrained_through_slurm(smoke_pipeline, tmp_path_factory):
    """The MoE run's shards and base model made through SLURM, from the local smoke pipeline's tokenizer and
    experts choice (copied with their mtimes and Snakemake's records, so they are up to date). The pretraining
    job stops itself after step 11 (checkpoint at 10), is killed with ``scancel --signal=KILL``, and rerun
    with ``--rerun-incomplete``. Returns (workdir, outputs, what the kill left and the rerun logged)."""
    local_cluster = started(Cluster.single_node(tmp_path_factory.mktemp("slurm-local")))
    try:
        return through_slurm(local_cluster, smoke_pipeline, tmp_path_factory)
    finally:
        local_cluster.stop()


def through_slurm(local_cluster: Cluster, smoke_pipeline: Path, tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("slurm-smoke") / "moeflow")
    outputs = smoke_outputs(workdir)
    for name in ("tokenizer", "experts"):
        shutil.copytree(smoke_pipeline / outputs[name], workdir / outputs[name], copy_function=shutil.copy2)
    shutil.copytree(smoke_pipeline / ".snakemake" / "metadata", workdir / ".snakemake" / "metadata")
    profile = local_profile(local_cluster, workdir.parent / "profile")
    log = workdir / outputs["base"].parent.parent / "logs" / "pretrain_base" / f"{outputs['base'].name}.log"
    args = (str(outputs["base"]), *SMOKE, "--workflow-profile", str(profile), *FAST_STATUS)

    kill = {KILL_ENV: f"pretrain_base.step{STEP_KILLED}", KILL_SCOPE_ENV: "stop"}
    env = snakemake_env(workdir, local_cluster, **kill, PYTHONUNBUFFERED="1")  # its output is read while it runs
    output = workdir.parent / "first-run.out"
    with open(output, "w") as out:
        first = subprocess.Popen(
            [sys.executable, "-m", "snakemake", *args], cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(
            lambda: log.is_file() and f"stopped at pretrain_base.step{STEP_KILLED}" in log.read_text(), first, output
        )
        job = next(j for j in local_cluster.jobs() if j["comment"].startswith("rule_pretrain_base_"))
        local_cluster.client("scancel", "--signal=KILL", job["id"])
        # Snakemake sees the job fail at its next status check. It would then take up to the plugin's status
        # interval (10 s longer after every check, up to 3 minutes) to shut down: killed instead, as its
        # session could be, which leaves its lock for --unlock.
        wait_for(lambda: "Error in rule pretrain_base" in output.read_text(), first, output)
    finally:
        first.kill()
        first.wait()
    killed = {
        "snakemake_output": output.read_text(),
        "job_state": local_cluster.job_state(job["id"]),
        "base_existed": (workdir / outputs["base"]).exists(),
        "checkpoints": sorted(p.name for p in workdir.glob("results/*/checkpoints/pretrain_base-*/step-*")),
        "rules_submitted": [call_comment(c) for c in local_cluster.sbatch_calls()],
    }
    for extra in ("--unlock", "--rerun-incomplete"):
        rerun = run_snakemake(workdir, local_cluster, *args, extra)
        assert rerun.returncode == 0, f"{extra} failed: {failure(rerun)}"
    killed["rerun_log"] = log.read_text()
    return workdir, outputs, killed


def wait_for(done, proc: subprocess.Popen, output: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"Snakemake ended early:\n{output.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"not within {timeout} s:\n{output.read_text()[-5000:]}"
        time.sleep(0.2)


def call_comment(argv: list[str]) -> str:
    return argv[argv.index("--comment") + 1]


@pytest.mark.slurm
@real_slurm
def test_smoke_stages_through_slurm_equal_the_local_run(pretrained_through_slurm, smoke_pipeline):
    workdir, outputs, killed = pretrained_through_slurm
    assert [c.split("_wildcards_")[0] for c in killed["rules_submitted"]] == ["rule_tokenize", "rule_pretrain_base"]
    assert files_of(workdir / outputs["shards"]) == files_of(smoke_pipeline / outputs["shards"])
    ours, local = files_of(workdir / outputs["base"]), files_of(smoke_pipeline / outputs["base"])
    assert [k for k in ours if not k.startswith(TENSORBOARD)] == [k for k in local if not k.startswith(TENSORBOARD)]
    # weights, tokenizer files, training summary byte for byte (metrics.jsonl: the resumed run's log, next test)
    different = [k for k in ours if not k.startswith(TENSORBOARD) and ours[k] != local[k]]
    assert different == ["training/metrics.jsonl"]


def logged_losses(metrics: bytes) -> list[tuple]:
    rows = [json.loads(line) for line in metrics.decode().splitlines()]
    return [(r["step"], r["loss"], r["ce"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


@pytest.mark.slurm
@real_slurm
def test_training_job_killed_by_scancel_resumes_from_its_checkpoint_to_the_same_losses(
    pretrained_through_slurm, smoke_pipeline
):
    workdir, outputs, killed = pretrained_through_slurm
    assert not killed["base_existed"], killed["snakemake_output"][-3000:]
    assert killed["job_state"] == "CANCELLED"
    assert re.search(r"SLURM-job '\d+' failed, SLURM status is: 'CANCELLED'", killed["snakemake_output"])
    assert killed["checkpoints"] == [f"step-{CHECKPOINT_EVERY:08d}"]
    resumed = rf"pretrain_base: continuing from \S+/step-{CHECKPOINT_EVERY:08d} at step {CHECKPOINT_EVERY}"
    assert re.search(resumed, killed["rerun_log"]), killed["rerun_log"][-2000:]
    ours = logged_losses((workdir / outputs["base"] / "training" / "metrics.jsonl").read_bytes())
    local = logged_losses((smoke_pipeline / outputs["base"] / "training" / "metrics.jsonl").read_bytes())
    # The local run logs every log_every (10) steps; the resumed one starts its log with every step the
    # checkpoint holds (1 to 10), then logs 20 and 30.
    assert [step for step, *_ in local] == [10, 20, 30]
    assert [step for step, *_ in ours] == [*range(1, CHECKPOINT_EVERY + 1), 20, 30]
    assert [loss for loss in ours if loss[0] in (10, 20, 30)] == local


# --------------------------------------------------------------------------- emulated GPU nodes


class Resources(dict):
    """A job's resources as the executor plugin reads them: ``.get(name)`` and ``.name``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class PlannedJob:
    """One job of Snakemake's dry run, with what the plugin's sbatch-line functions read of a job (``name``,
    ``wildcards`` as values, ``threads``, ``resources``)."""

    def __init__(self, rule: str, wildcards: dict[str, str], outputs: list[str], threads: int, resources: Resources):
        self.name, self.outputs, self.threads, self.resources = rule, outputs, threads, resources
        self.wildcards = list(wildcards.values())
        self.wildcards_dict = wildcards


def profile_config(workdir: Path) -> tuple[str, ...]:
    """The smoke config with config/config.yaml's ``threads`` (a rule's CPUs per job, as a user's config has them;
    the smoke overlay runs one thread per job): what the emulated GPU nodes' jobs are planned and run with."""
    overlay = workdir / "config" / "profile_threads.yaml"
    overlay.write_text(yaml.safe_dump({"threads": load()["threads"]}))
    return (*SMOKE, str(overlay.relative_to(workdir)))


def planned_jobs(workdir: Path, profile: str) -> list[PlannedJob]:
    """Every job of the smoke pipeline's DAG (train, evaluate, paper), as ``snakemake --dry-run --forceall``
    with ``profile`` lists it: rule, wildcards, outputs, threads and resources. (``--cores``: a dry run caps
    threads at its cores, a cluster run does not.)"""
    config = profile_config(workdir)
    args = ("paper", "train", "evaluate", *config, "--workflow-profile", str(PROFILES / profile), "-n", "--forceall")
    args += ("--cores", "1024")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir,
        env=workflow_env(workdir),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, failure(proc)
    jobs, block = [], None
    for line in proc.stdout.splitlines() + [""]:
        head = re.fullmatch(r"(?:local)?rule (\w+):", line)
        if head or not line.startswith("    "):
            if block and block["rule"] not in ("train", "evaluate"):
                jobs.append(block_job(block))
            block = {"rule": head.group(1)} if head else None
        elif block is not None and ": " in line:
            key, value = line.strip().split(": ", 1)
            block[key] = value
    return jobs


def block_job(block: dict[str, str]) -> PlannedJob:
    def pairs(text: str) -> dict[str, str]:
        return dict(item.split("=", 1) for item in text.split(", ")) if text else {}

    resources = Resources(
        {k: int(v) if v.isdigit() else v for k, v in pairs(block.get("resources", "")).items() if v != "<TBD>"}
    )
    outputs = block.get("output", "").split(", ")
    return PlannedJob(
        block["rule"], pairs(block.get("wildcards", "")), outputs, int(block.get("threads", 1)), resources
    )


def plugin_sbatch_line(job: PlannedJob, workdir: Path) -> list[str]:
    """The sbatch arguments the installed plugin writes for ``job`` (its run_job without the submission:
    get_submit_command, then set_gres_string; no account, as on a cluster without accounting), before --wrap."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import get_job_wildcards, set_gres_string

    wildcards = get_job_wildcards(job)
    params = {
        "run_uuid": "<run-uuid>",
        "slurm_logfile": workdir / ".snakemake" / "slurm_logs" / f"rule_{job.name}" / wildcards / "%j.log",
        "comment_str": f"rule_{job.name}_wildcards_{wildcards}" if wildcards else f"rule_{job.name}",
        "account": "",
        "partition": f" -p {shlex.quote(job.resources['slurm_partition'])}",
        "workdir": workdir,
    }
    return shlex.split(get_submit_command(job, params) + set_gres_string(job))


def normalized(argv: list[str], workdir: Path) -> list[str]:
    """An sbatch call with the run's id, the workflow folder and the jobstep's command line left out."""
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--job-name":
            arg = "<run-uuid>"
        elif arg.startswith("--wrap="):
            arg = WRAP
        out.append(arg.replace(f"{workdir}/", "").replace(str(workdir), "<workdir>"))
    return out


WRAP = "--wrap=<the jobstep's command>"  # python -m snakemake ... --executor slurm-jobstep ...: runs the job
# in the docs: the training job, a one-GPU rule, a CPU rule
DOC_RULES = ("train_model", "evaluate_model", "plan_memory")
GPU_NODES = {"slurm": 1, "slurm-multinode": 6}  # each profile's training job, on that many 8-GPU nodes


@pytest.fixture(scope="module", params=sorted(GPU_NODES))
def planned(request, tmp_path_factory) -> tuple[str, Path, list[PlannedJob]]:
    """(profile, a workflow copy, every job the dry run with the profile plans in it)."""
    profile = request.param
    workdir = copy_workflow(tmp_path_factory.mktemp(f"{profile}-run") / "moeflow")
    return profile, workdir, planned_jobs(workdir, profile)


@pytest.fixture(scope="module")
def on_gpu_nodes(planned, tmp_path_factory):
    """The profile on a cluster of its emulated GPU nodes: the train_model job of the MoE run submitted
    through the plugin (every other output faked), its torchrun recorded."""
    profile, workdir, jobs = planned
    cluster = started(Cluster.gpu_nodes(tmp_path_factory.mktemp(f"slurm-{profile}"), GPU_NODES[profile]))
    try:
        train = next(j for j in jobs if j.name == "train_model" and j.wildcards_dict == {"run": "moe"})
        stamp = time.time()
        for path in (workdir / out for job in jobs if job is not train for out in job.outputs):
            if path.suffix:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                path.mkdir(parents=True, exist_ok=True)
            os.utime(path, (stamp, stamp))
        env = {"PYTHONPATH": os.pathsep.join([str(RECORDER), os.environ.get("PYTHONPATH", "")])}
        args = (train.outputs[0], *profile_config(workdir), "--workflow-profile", str(PROFILES / profile), *FAST_STATUS)
        proc = run_snakemake(workdir, cluster, *args, "--slurm-keep-successful-logs", env=env)
        calls = [c for c in cluster.sbatch_calls() if call_comment(c) == "rule_train_model_wildcards_moe"]
        assert len(calls) == 1, f"train_model was not submitted once ({len(calls)}): {failure(proc)}"
        submitted = calls[0]
        job_id = next(j["id"] for j in cluster.jobs() if j["comment"] == "rule_train_model_wildcards_moe")
        slurm_log = workdir / ".snakemake" / "slurm_logs" / "rule_train_model" / "moe" / f"{job_id}.log"
        output = slurm_log.read_text() if slurm_log.is_file() else ""
        agents = [
            json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("torchrun-recorder ")
        ]
        yield {
            "profile": profile,
            "cluster": cluster,
            "workdir": workdir,
            "jobs": jobs,
            "train": train,
            "snakemake": proc,
            "submitted": submitted,
            "job": {**cluster.job(job_id), "state": cluster.job_state(job_id), "id": job_id, "output": output},
            "agents": agents,
        }
    finally:
        cluster.stop()


def one_job_per_rule(jobs: list[PlannedJob]) -> dict[str, PlannedJob]:
    """A job of every rule: the MoE run's where the rule has a run wildcard."""
    chosen: dict[str, PlannedJob] = {}
    for job in sorted(jobs, key=lambda j: j.wildcards_dict.get("run") != "moe"):
        chosen.setdefault(job.name, job)
    return chosen


@pytest.mark.slurm
@real_slurm
def test_every_rule_of_the_shipped_profile_is_accepted_by_sbatch(on_gpu_nodes):
    run = on_gpu_nodes
    rules = one_job_per_rule(run["jobs"])
    assert len(rules) >= 15, sorted(rules)
    refused = {}
    for rule, job in rules.items():
        line = [a for a in plugin_sbatch_line(job, run["workdir"]) if a != "--parsable"]
        proc = run["cluster"].client("sbatch", *line[1:], "--test-only", "--wrap", "true", check=False)
        if proc.returncode != 0:
            refused[rule] = f"{shlex.join(line)}: {proc.stderr.strip()}"
    assert refused == {}, "\n".join(f"{rule}: {why}" for rule, why in refused.items())


@pytest.mark.slurm
@real_slurm
def test_the_plugin_submits_train_model_as_its_functions_write_it(on_gpu_nodes):
    run = on_gpu_nodes
    assert run["snakemake"].returncode == 0, failure(run["snakemake"])
    submitted = normalized(run["submitted"], run["workdir"])
    assert submitted[-1].startswith("--wrap=")
    assert submitted[:-1] == normalized(plugin_sbatch_line(run["train"], run["workdir"]), run["workdir"])
    assert "--ntasks-per-gpu" not in " ".join(submitted)  # one task, or one per node: never one per GPU


def torchrun_options(argv: list[str]) -> dict[str, str | bool]:
    """torchrun's options: ``--name value``, or ``--name`` alone (True)."""
    options: dict[str, str | bool] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
            options[arg] = value
    return options


@pytest.mark.slurm
@real_slurm
def test_train_model_starts_one_torchrun_agent_per_node(on_gpu_nodes):
    run = on_gpu_nodes
    nodes, gpus = run["train"].resources["nodes"], run["train"].resources["gpu"]
    job, agents = run["job"], run["agents"]
    assert job["state"] == "COMPLETED", f"{job['state']}:\n{job['output'][-4000:]}\n{failure(run['snakemake'])}"
    allocated = run["cluster"].client("scontrol", "show", "hostnames", job["NodeList"]).stdout.split()
    assert len(allocated) == nodes and len(agents) == nodes, job["output"][-3000:]
    assert sorted(int(a["env"]["SLURM_NODEID"]) for a in agents) == list(range(nodes))  # each node once
    assert sorted(a["env"]["SLURMD_NODENAME"] for a in agents) == sorted(allocated)
    for agent in agents:
        option, env = torchrun_options(agent["torchrun"]), agent["env"]
        assert option["--nproc_per_node"] == str(gpus // nodes)
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == gpus // nodes  # the node's GPUs, one per rank
        assert agent["script"] == "workflow/scripts/train_model.py"
        if nodes == 1:
            assert option.get("--standalone") is True and "--nnodes" not in option
        else:
            assert option["--nnodes"] == str(nodes) and option["--rdzv-backend"] == "c10d"
            assert option["--rdzv-endpoint"] == f"{allocated[0]}:29500"  # the first node of the allocation
            assert option["--rdzv-id"] == job["id"]


@pytest.mark.pipeline
def test_docs_show_the_sbatch_lines_the_plugin_writes(planned):
    """On both stacks (plugin 2.6.1 and 2.8.0): the lines the installed plugin writes for the profile are the
    documented ones, which the pinned stack's real-SLURM tests submit (train_model end to end)."""
    profile, workdir, jobs = planned
    rules = one_job_per_rule(jobs)
    lines = [normalized(plugin_sbatch_line(rules[rule], workdir), workdir) + [WRAP] for rule in DOC_RULES]
    docs = DOCS.read_text()
    missing = [" ".join(line) for line in lines if " ".join(line) not in docs]
    assert missing == [], f"docs/scaling-out.md lacks what profiles/{profile} submits:\n" + "\n".join(missing)
