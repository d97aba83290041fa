"""moeflow.evaluation.sandbox: an untrusted program runs in its own isolated interpreter; code that hangs, forks, writes
outside its folder, opens a socket, floods its output or signals the pipeline ends with a status saying
which and harms nothing. Each case runs with the network and PID namespaces (where unshare can make them)
and with the audit hook alone."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from moeflow.evaluation import sandbox
from moeflow.evaluation.sandbox import Limits, run, run_many

FAST = Limits(wall_s=3.0, memory_mb=256)
ISOLATIONS = [
    pytest.param(
        True,
        id="namespaces",
        marks=pytest.mark.skipif(not sandbox.namespaces_available(), reason="unshare cannot make namespaces here"),
    ),
    pytest.param(False, id="audit_hook"),
]


@pytest.fixture(params=ISOLATIONS)
def namespaces(request):
    return request.param


def processes_with(*texts: str) -> list[int]:
    """Live processes whose command line contains every one of ``texts``."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmdline = Path(path).read_bytes()
            if all(text.encode() in cmdline for text in texts):
                found.append(int(path.split("/")[2]))
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def nothing_left_running():
    """After every test: no sandboxed interpreter is left, and the test process is where it was."""

    def state():
        return os.getcwd(), {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}

    before = state()
    yield
    time.sleep(0.1)
    # this interpreter's launchers only: the other stack's suite may be running its own beside this one (CI)
    assert processes_with(str(sandbox.LAUNCHER), sys.executable) == []
    assert state() == before


def test_a_program_runs_and_its_output_is_captured(namespaces):
    outcome = run("import sys\nprint('out')\nprint('err', file=sys.stderr)", FAST, namespaces)
    assert (outcome.status, outcome.returncode, outcome.stdout, outcome.stderr) == ("ok", 0, "out\n", "err\n")
    assert outcome.isolation == ("namespaces" if namespaces else "audit_hook")


def test_exceptions_and_exit_codes_are_errors(namespaces):
    assert run("1 / 0", FAST, namespaces).stderr.strip().endswith("ZeroDivisionError: division by zero")
    assert run("1 / 0", FAST, namespaces).status == "error"
    assert run("def f(:\n", FAST, namespaces).status == "error"
    assert (run("raise SystemExit(3)", FAST, namespaces).returncode, run("pass", FAST, namespaces).returncode) == (3, 0)


def test_an_isolated_interpreter_with_a_clean_environment(namespaces, monkeypatch):
    monkeypatch.setenv("MOEFLOW_SANDBOX_SECRET", "s3cret")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    code = (
        "import os, sys, json\nf = sys.flags\nprint(json.dumps([dict(os.environ), f.isolated, f.no_site, os.getcwd()]))"
    )
    environ, isolated, no_site, cwd = json.loads(run(code, FAST, namespaces).stdout)
    assert set(environ) == {"PATH", "LANG", "HOME", "TMPDIR"} and environ["HOME"] == environ["TMPDIR"] == cwd
    assert (isolated, no_site) == (1, 1)


def test_each_run_has_a_fresh_folder_that_is_removed(namespaces):
    code = "import os\nprint(os.getcwd(), sorted(os.listdir('.')))\nopen('left.txt', 'w').write('x')"
    first, second = (run(code, FAST, namespaces).stdout.split(" ", 1) for _ in range(2))
    assert first[1] == second[1] == "[]\n"  # nothing left by the first run
    assert first[0] != second[0] and not Path(first[0]).exists() and not Path(first[0]).parent.exists()


def test_a_hanging_program_is_killed_at_the_wall_clock_limit(namespaces):
    start = time.monotonic()
    outcome = run("import time\nwhile True:\n    time.sleep(1)", Limits(wall_s=1.0), namespaces)
    assert outcome.status == "timeout" and outcome.returncode is None
    assert time.monotonic() - start < 5


def test_a_busy_program_hits_the_cpu_limit(namespaces):
    outcome = run("while True:\n    pass", Limits(wall_s=20.0, cpu_limit_s=1), namespaces)
    assert outcome.status == "cpu_limit" and outcome.seconds < 10


def test_a_program_over_the_memory_limit_fails(namespaces):
    outcome = run("block = bytearray(1 << 30)", Limits(memory_mb=128), namespaces)
    assert outcome.status == "memory" and "MemoryError" in outcome.stderr


def test_an_output_flood_is_bounded(namespaces):
    outcome = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", Limits(file_size_mb=1), namespaces)
    assert outcome.status == "output_limit" and len(outcome.stdout) == Limits().keep_output_bytes


# the seconds the refused programs would sleep: this process's own number, so that a `sleep` another suite or
# user runs on the machine is never mistaken for one that escaped
SLEEP = str(30 + os.getpid() % 10_000)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except BaseException:\n        pass",
        f"import subprocess\nsubprocess.run(['sleep', '{SLEEP}'])",
        f"import os\nos.system('sleep {SLEEP}')",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        f"import os\nos.posix_spawn('/bin/sleep', ['sleep', '{SLEEP}'], {{}})",
        "import sys, _posixsubprocess\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
    ],
    ids=["fork_bomb", "fork_bomb_catching", "subprocess", "system", "multiprocessing", "posix_spawn", "reimport"],
)
def test_starting_a_process_is_refused_and_nothing_survives(namespaces, code):
    outcome = run(code, FAST, namespaces)
    assert outcome.status == "fork" and "refused (fork)" in outcome.stderr
    assert processes_with(f"sleep {SLEEP}") == [] and processes_with(f"sleep\x00{SLEEP}") == []


@pytest.mark.skipif(not sandbox.namespaces_available(), reason="unshare cannot make namespaces here")
def test_a_process_started_past_the_audit_hook_dies_with_the_run(tmp_path):
    # a fresh copy of the C module that subprocess forks through: the audit hook does not see this fork, but
    # the process is in the run's PID namespace (and would otherwise have escaped the process group: setsid)
    marker = f"moeflow-sandbox-escape-{os.getpid()}"
    code = f"""
import _imp, importlib.machinery as m, os, sys
import _posixsubprocess as patched
origin = patched.__spec__.origin
loader = m.ExtensionFileLoader("_posixsubprocess", origin)
fresh = _imp.create_dynamic(m.ModuleSpec("_posixsubprocess", loader, origin=origin))
args = [sys.executable.encode(), b"-c", b"import time; time.sleep(60)  # {marker}"]
r, w = os.pipe()
fds = [-1] * 6
fresh.fork_exec(args, args[:1], True, (), None, None, *fds, r, w, True, True, -1, None, None, None, -1, None, False)
print("started", flush=True)
"""
    try:
        outcome = run(code, FAST, namespaces=True)
        time.sleep(0.3)
        if outcome.stdout.strip() != "started":
            pytest.skip(f"this Python cannot start the process past the hook: {outcome.stderr[-200:]}")
        assert processes_with(marker) == []
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def outside(tmp_path):
    """A folder outside the sandbox with a file in it."""
    (tmp_path / "kept.txt").write_text("original")
    return tmp_path


@pytest.mark.parametrize(
    "code",
    [
        "open({new!r}, 'w').write('x')",
        "open({kept!r}, 'a').write('x')",
        "import os\nos.close(os.open({new!r}, os.O_WRONLY | os.O_CREAT))",
        "import os\nos.remove({kept!r})",
        "import os\nos.rename({kept!r}, 'stolen.txt')",
        "import os\nos.link({kept!r}, 'link.txt')",
        "import os\nos.symlink({folder!r}, 'out')\nopen('out/new.txt', 'w').write('x')",
        "import shutil\nshutil.rmtree({folder!r})",
        "import pathlib\npathlib.Path({new!r}).write_text('x')",
        "import os\nos.chmod({kept!r}, 0)",
        "open('../escaped.txt', 'w').write('x')",
    ],
    ids=["open", "append", "os_open", "remove", "rename", "link", "symlink", "rmtree", "pathlib", "chmod", "dotdot"],
)
def test_writing_outside_its_folder_is_refused_and_changes_nothing(namespaces, outside, code):
    paths = {"new": str(outside / "new.txt"), "kept": str(outside / "kept.txt"), "folder": str(outside)}
    outcome = run(code.format(**paths), FAST, namespaces)
    assert outcome.status == "write_outside" and "refused (write_outside)" in outcome.stderr
    assert sorted(p.name for p in outside.iterdir()) == ["kept.txt"]
    assert (outside / "kept.txt").read_text() == "original" and os.access(outside / "kept.txt", os.W_OK)


def test_writing_inside_its_folder_works(namespaces):
    code = (
        "import os, shutil, tempfile\nos.makedirs('a/b')\nopen('a/b/c.txt', 'w').write('1')\n"
        "print(open('a/b/c.txt').read())\nshutil.rmtree('a')\nos.close(tempfile.mkstemp()[0])\n"
        "os.mkdir('locked')\nopen('locked/f', 'w').close()\nos.chmod('locked', 0)"
    )
    outcome = run(code, FAST, namespaces)
    assert (outcome.status, outcome.stdout) == ("ok", "1\n")


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
        "import socket\nsocket.getaddrinfo('localhost', {port})",
    ],
    ids=["tcp", "udp", "urllib", "dns"],
)
def test_opening_a_socket_is_refused_and_nothing_connects(namespaces, code):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        outcome = run(code.format(port=server.getsockname()[1]), FAST, namespaces)
        assert outcome.status == "network" and "refused (network)" in outcome.stderr
        with pytest.raises(BlockingIOError):
            server.accept()


@pytest.mark.skipif(not sandbox.namespaces_available(), reason="unshare cannot make namespaces here")
def test_the_network_namespace_has_no_interface_but_loopback():
    outcome = run("print(open('/proc/net/dev').read())", FAST, namespaces=True)
    interfaces = [line.split(":")[0].strip() for line in outcome.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


@pytest.mark.parametrize(
    "code",
    [
        "import os, signal\nos.kill({pid}, signal.SIGTERM)",
        "import os, signal\nos.killpg({pgid}, signal.SIGTERM)",
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
        "import ctypes",
        "import gc\ngc.get_objects()",
        "import os\nos.chdir('/')",
        "import os\nos.open('/', os.O_RDONLY)",
    ],
    ids=["kill", "killpg", "setrlimit", "ctypes", "gc", "chdir", "dir_fd"],
)
def test_reaching_past_the_sandbox_is_refused(namespaces, code):
    outcome = run(code.format(pid=os.getpid(), pgid=os.getpgrp()), FAST, namespaces)
    assert outcome.status == "forbidden" and "refused (forbidden)" in outcome.stderr  # and this test still runs


def test_run_many_keeps_the_order_and_runs_in_parallel(namespaces):
    sources = [f"import time\ntime.sleep(1)\nprint({i})" for i in range(4)]
    start = time.monotonic()
    outcomes = run_many(sources, FAST, threads=4, namespaces=namespaces)
    assert [o.stdout for o in outcomes] == ["0\n", "1\n", "2\n", "3\n"]
    assert time.monotonic() - start < 3.5  # 4 s one after the other
