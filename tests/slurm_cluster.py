"""A real SLURM cluster on this machine, from Debian's packages (munge, slurmctld, slurmd, slurm-client).

One munged, one slurmctld and one slurmd per node, all in one folder with their own ports, munge socket,
state and logs, so two clusters (two test sessions, or `make slurm-up` next to the tests) never meet.
Stopped by the PIDs this module started: the daemons, then whatever the cluster's jobs left behind
(found by the marker every daemon and client of this cluster carries in its environment); a test session
that dies before its teardown takes its daemons with it.

- ``Cluster.single_node(root)``: this machine as one node, its real cores and (less than) its memory,
  in the partitions the profiles name (``cpu`` and ``gpu``).
- ``Cluster.gpu_nodes(root, n)``: ``n`` emulated 8-GPU nodes (and one CPU node) as ``slurmd -N`` daemons
  on this host, declaring more cores and memory than it has (``SlurmdParameters=config_overrides``)
  and stand-in GPU device files in ``gres.conf``: sbatch and srun allocate them like real GPUs
  (``CUDA_VISIBLE_DEVICES`` included); nothing can compute on them.

SLURM's clients find a cluster through ``SLURM_CONF``, but the executor plugin's jobstep removes every
``SLURM_*`` variable but the job id from the environment of the command it runs, so the clients are
reached through small wrappers in ``<root>/bin`` (put first on ``PATH``) that set it and run the real
command. A cluster's daemons run as root (this must run as root, as CI does); a missing installation
is installed with apt-get.

Standard library only: ``make slurm-up`` / ``make slurm-down`` run it as a script.

    python tests/slurm_cluster.py up .slurm      # prints the PATH line to use it
    python tests/slurm_cluster.py down .slurm
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "squeue", "scontrol", "scancel", "sinfo", "sacct", "sacctmgr", "sshare")
PARTITIONS = ("cpu", "gpu")  # the partition names of profiles/slurm and profiles/slurm-multinode
MARKER = "MOEFLOW_SLURM_ROOT"  # in the environment of every daemon, client and job of a cluster
GPU_TYPE = "h100"  # the profiles' gpu_model
# An emulated GPU node: 8 GPUs, the cores and host memory of a typical 8 x H100 server.
GPU_NODE_CPUS, GPU_NODE_MEMORY_MB = 112, 1_000_000
CPU_NODE_CPUS, CPU_NODE_MEMORY_MB = 64, 256_000


class Unavailable(RuntimeError):
    """SLURM cannot run here (not root, no apt-get, a daemon that does not start): the reason."""


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int = 0
    partitions: tuple[str, ...] = PARTITIONS
    # the topology line of a real node (from slurmd -C); emulated nodes give CPUs only
    topology: str = ""


# Where Debian installs SLURM's commands: looked up here, never through PATH, which may hold a cluster's wrappers.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def system_command(cmd: str) -> str:
    return shutil.which(cmd, path=SYSTEM_PATH) or f"/usr/bin/{cmd}"


def missing_commands() -> list[str]:
    return [cmd for cmd in (*DAEMONS, *CLIENTS) if not shutil.which(cmd, path=SYSTEM_PATH)]


def install() -> None:
    """Install Debian's SLURM and munge if a command is missing (root and apt-get needed)."""
    if not missing_commands():
        return
    packages = " ".join(PACKAGES)
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable(f"SLURM is not installed and cannot be installed here: as root, apt-get install {packages}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env, capture_output=True, text=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)  # a fresh machine's lists
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"apt-get install {packages} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if missing_commands():
        raise Unavailable(f"after apt-get install {packages}, still missing: {', '.join(missing_commands())}")


def this_machine() -> dict[str, int | str]:
    """``slurmd -C``: this machine's CPUs, topology and memory (MB), as slurmd sees them."""
    install()
    out = subprocess.run([system_command("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split("=", 1) for item in out.split("\n", 1)[0].split())
    topology = " ".join(f"{k}={fields[k]}" for k in ("Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore"))
    return {"cpus": int(fields["CPUs"]), "memory_mb": int(fields["RealMemory"]), "topology": topology}


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Cluster:
    root: Path
    nodes: list[Node]
    emulated: bool
    name: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    # the daemons end with the process that started them (a test session killed before its teardown
    # leaves none behind); `slurm_cluster.py up` keeps them running for slurm-down
    outlive_starter: bool = False

    # ------------------------------------------------------------------ the two kinds

    @classmethod
    def single_node(cls, root: Path, memory_mb: int | None = None) -> Cluster:
        """This machine as one node (its cores; ``memory_mb``, default the machine's less 25%, as RealMemory)."""
        machine = this_machine()
        memory = memory_mb or int(machine["memory_mb"]) * 3 // 4
        return cls(Path(root), [Node("node1", int(machine["cpus"]), memory, topology=str(machine["topology"]))], False)

    @classmethod
    def gpu_nodes(cls, root: Path, count: int) -> Cluster:
        """``count`` emulated 8-GPU nodes in partition gpu, and one CPU node in partition cpu."""
        nodes = [Node("cpu1", CPU_NODE_CPUS, CPU_NODE_MEMORY_MB, partitions=("cpu",))]
        nodes += [Node(f"gpu{i}", GPU_NODE_CPUS, GPU_NODE_MEMORY_MB, 8, ("gpu",)) for i in range(1, count + 1)]
        return cls(Path(root), nodes, True)

    # ------------------------------------------------------------------ paths and environment

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def env(self) -> dict[str, str]:
        """Variables to run this cluster's clients with: its wrappers first on PATH."""
        return {"PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}"}

    def client(self, cmd: str, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.bin / cmd), *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{cmd} {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld knows (finished ones for MinJobAge): id, state, reason, nodes, partition and
        comment (the executor plugin's ``rule_<rule>_wildcards_<wildcards>``)."""
        out = self.client("squeue", "--states=all", "--noheader", "--format=%i|%T|%r|%N|%P|%k").stdout
        keys = ("id", "state", "reason", "nodes", "partition", "comment")
        return [dict(zip(keys, line.split("|", len(keys) - 1))) for line in out.splitlines() if line.strip()]

    def sbatch_calls(self) -> list[list[str]]:
        """Every sbatch command line so far (``sbatch`` and its arguments), in the order they were made."""
        calls = sorted((self.root / "log" / "sbatch").iterdir(), key=lambda p: p.stat().st_mtime_ns)
        return [["sbatch", *p.read_bytes().decode().split("\0")[:-1]] for p in calls]

    def job_state(self, job_id: str) -> str:
        return next((j["state"] for j in self.jobs() if j["id"] == job_id), "UNKNOWN")

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of one job (TRES, NumNodes, NumCPUs, Partition, ...)."""
        out = self.client("scontrol", "show", "job", "--oneliner", job_id).stdout.strip()
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    # ------------------------------------------------------------------ configuration

    def _write_config(self) -> None:
        for sub in ("etc", "bin", "munge", "state", "log", "run", "dev", "spool"):  # a fresh cluster every start
            shutil.rmtree(self.root / sub, ignore_errors=True)
        for sub in ("etc", "bin", "munge", "state", "log", "run", "dev", *(f"spool/{n.name}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        self.name = f"moeflow{os.getpid()}{ctld_port}"  # unique while this cluster runs
        host = socket.gethostname().split(".")[0]
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.root / 'munge' / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
            # what works in a container: no cgroups
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",  # no slurmdbd: sacct has nothing to say
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "GresTypes=gpu",
            "MinJobAge=600",  # finished jobs stay visible to squeue (the profiles' status command)
            "ReturnToService=2",
            "KillWait=5",
            "SlurmdTimeout=300",
            "InactiveLimit=0",
            "PlugStackConfig=/dev/null",
        ]
        if self.emulated:
            lines.append("SlurmdParameters=config_overrides")
        gres = ["AutoDetect=off"]
        for node, port in zip(self.nodes, node_ports):
            hardware = f"{node.topology or f'CPUs={node.cpus}'} RealMemory={node.memory_mb}"
            line = f"NodeName={node.name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} {hardware} State=UNKNOWN"
            if node.gpus:
                line += f" Gres=gpu:{GPU_TYPE}:{node.gpus}"
                for i in range(node.gpus):
                    _stand_in_device(self.root / "dev" / f"nvidia{i}")
                devices = f"{self.root / 'dev'}/nvidia[0-{node.gpus - 1}]"
                gres.append(f"NodeName={node.name} Name=gpu Type={GPU_TYPE} File={devices}")
            lines.append(line)
        for partition in PARTITIONS:
            members = [n.name for n in self.nodes if partition in n.partitions]
            if members:
                default = " Default=YES" if partition == "cpu" else ""
                lines.append(f"PartitionName={partition} Nodes={','.join(members)} MaxTime=INFINITE State=UP{default}")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.root / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")
        (self.root / "log" / "sbatch").mkdir()
        for cmd in CLIENTS:
            wrapper = self.bin / cmd
            # sbatch also keeps its arguments (NUL-separated, one file per call): what was really submitted
            keep = f'printf \'%s\\0\' "$@" > "$(mktemp {self.root / "log" / "sbatch"}/XXXXXX)"\n'
            run = f'SLURM_CONF={self.conf} {MARKER}={self.root} exec {system_command(cmd)} "$@"'
            wrapper.write_text(f"#!/bin/sh\n{keep if cmd == 'sbatch' else ''}{run}\n")
            wrapper.chmod(0o755)

    # ------------------------------------------------------------------ daemons

    def _spawn(self, key: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{key}.out", "ab")
        env = {**os.environ, MARKER: str(self.root), "SLURM_CONF": str(self.conf)}
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=None if self.outlive_starter else _end_with_parent,
        )
        self.pids[key] = proc.pid
        self._save()

    def _save(self) -> None:
        state = {
            "name": self.name,
            "emulated": self.emulated,
            "pids": self.pids,
            "nodes": [asdict(n) for n in self.nodes],
        }
        (self.root / "cluster.json").write_text(json.dumps(state, indent=1))

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [key for key, pid in self.pids.items() if not _alive(pid)]
            if dead:
                raise Unavailable(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs(dead)}")
            if ready():
                return
            time.sleep(0.2)
        raise Unavailable(f"{what}: not within {timeout:.0f} s\n{self.logs()}")

    def logs(self, keys=None) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            if keys is None or any(path.name.startswith(k) for k in keys):
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def start(self, timeout: float = 60) -> Cluster:
        """Install SLURM if needed, write the configuration, start the daemons, wait until every node is idle."""
        install()
        if os.geteuid() != 0:
            raise Unavailable("the SLURM daemons run as root here: run as root")
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_config()
        key = self.root / "munge" / "munge.key"
        subprocess.run(
            [system_command("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True
        )
        key.chmod(0o600)
        munge = self.root / "munge"
        try:
            self._spawn(
                "munged",
                [
                    system_command("munged"),
                    "--foreground",
                    "--force",
                    f"--socket={munge / 'munge.socket'}",
                    f"--key-file={key}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--log-file={self.root / 'log' / 'munged.log'}",
                    f"--seed-file={munge / 'munged.seed'}",
                ],
            )
            self._wait("munged's socket", (munge / "munge.socket").exists, 15)
            self._spawn("slurmctld", [system_command("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait("slurmctld", lambda: self.client("sinfo", "--noheader", check=False).returncode == 0, timeout)
            for node in self.nodes:
                self._spawn(
                    f"slurmd-{node.name}", [system_command("slurmd"), "-D", "-f", str(self.conf), "-N", node.name]
                )
            self._wait("every node idle", self._all_idle, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _all_idle(self) -> bool:
        out = self.client("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).stdout
        states = {}
        for line in out.splitlines():
            name, state = line.split()
            states[name] = state
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    def stop(self, timeout: float = 20) -> None:
        """Cancel the cluster's jobs, stop its daemons by their PIDs, then end what its jobs left running."""
        if self.pids.get("slurmctld") and _alive(self.pids["slurmctld"]):
            self.client("scancel", "--full", "--signal=KILL", "--state=RUNNING", "-u", "root", check=False)
            self.client("scancel", "-u", "root", check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if not [
                        j for j in self.jobs() if j["state"] in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING")
                    ]:
                        break
                except (RuntimeError, subprocess.TimeoutExpired):
                    break
                time.sleep(0.3)
        order = [k for k in self.pids if k.startswith("slurmd-")] + ["slurmctld", "munged"]
        for key in order:
            pid = self.pids.get(key)
            if pid:
                _terminate(pid, timeout)
        for pid in _marked_processes(self.root):
            _terminate(pid, 5)
        self.pids.clear()
        if self.root.exists():
            self._save()

    @classmethod
    def attach(cls, root: Path) -> Cluster:
        """The cluster ``start`` left in ``root`` (its PIDs from cluster.json), to stop it."""
        state = json.loads((Path(root) / "cluster.json").read_text())
        nodes = [Node(**{**n, "partitions": tuple(n["partitions"])}) for n in state["nodes"]]
        return cls(Path(root), nodes, state["emulated"], state["name"], state["pids"])


def _end_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie that is not our child
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _terminate(pid: int, timeout: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.1)


def _stand_in_device(path: Path) -> None:
    """A GPU's device file as slurmd wants one (a character device): /dev/null's numbers, so opening it
    opens nothing that computes, whatever driver the machine has."""
    if path.exists():
        return
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError as exc:
        raise Unavailable(f"cannot create the stand-in GPU device {path} (mknod): {exc}") from None


def _marked_processes(root: Path) -> list[int]:
    """Processes whose environment carries this cluster's marker (slurmstepd and job processes outlive slurmd)."""
    marker = f"{MARKER}={root}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: slurm_cluster.py up|down FOLDER", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "up":
        if (root / "cluster.json").exists() and any(_alive(p) for p in Cluster.attach(root).pids.values()):
            print(f"a cluster already runs in {root} (make slurm-down first)", file=sys.stderr)
            return 1
        cluster = Cluster.single_node(root)
        cluster.outlive_starter = True
        cluster.start()
        print(f"SLURM cluster {cluster.name} up in {root}: partitions {', '.join(PARTITIONS)} on this machine.")
        print(f'Use it with: export PATH="{cluster.bin}:$PATH"')
    else:
        if (root / "cluster.json").exists():
            Cluster.attach(root).stop()
            print(f"SLURM cluster in {root} stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
