"""The first code of a sandboxed interpreter: resource limits, the audit hook, then the program.

moeflow.evaluation.sandbox starts ``python -I -B -S`` on this file, which sets the resource limits, installs the
audit hook that refuses what a program may not do, then runs the program.

Standard library only, and nothing at import: moeflow.evaluation.sandbox imports this module for its path.

``python sandbox_launcher.py LIMITS_JSON PROGRAM_FILE`` with the working directory the program's own
folder. The limits (``resource``) bind the kernel: CPU seconds (SIGXCPU, then SIGKILL), address space,
the size of any file written (stdout and stderr included), and no new process or thread (RLIMIT_NPROC 0,
which the kernel does not apply to root: the hook refuses forks for root too). The hook (``sys.addaudithook``,
which the program cannot remove) ends the process at once with an exit code saying what was refused:
starting a process, writing outside the working directory, any socket, and ctypes, signals to other
processes, raising the limits or walking the garbage collector's objects (ways to reach past the hook).
A program can catch neither: ``os._exit`` runs no handler. The hook holds against accidental harm and
casual attempts; the kernel's layers (limits, the network and PID namespaces moeflow.evaluation.sandbox adds where it
can, the process-group kill) do not depend on it.
"""

import json
import os
import resource
import sys

# Exit codes of a refusal (moeflow.evaluation.sandbox maps them to statuses); 1 is an uncaught exception.
EXIT_CODES = {"fork": 90, "write_outside": 91, "network": 92, "forbidden": 93, "memory": 94}


PROCESS_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen", "pty.spawn"}
)


# File-system events that change something at their path argument (the first; os.rename's second as well).
WRITE_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.mkdir",
        "os.rmdir",
        "os.chmod",
        "os.chown",
        "os.chflags",
        "os.lchflags",
        "os.truncate",
        "os.utime",
        "os.symlink",
        "os.link",
        "os.setxattr",
        "os.removexattr",
        "os.mkfifo",
        "os.mknod",
        "shutil.rmtree",
        "shutil.chown",
        "sqlite3.connect",
    }
)


TWO_PATH_EVENTS = frozenset({"os.rename", "os.link"})  # (source, destination): both must be inside


FORBIDDEN_EVENTS = frozenset(
    {
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "resource.setrlimit",
        "resource.prlimit",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys._current_frames",
        "os.chdir",  # the working directory stays the one every relative path is checked against
    }
)


OPEN_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


ALWAYS_WRITABLE = ("/dev/null",)


def set_limits(limits):
    """Soft and hard limits alike: the program cannot raise them again (nor could it without the hook, unless
    it runs as root outside a user namespace)."""
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(limits["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(limits["file_size_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def refuse(kind, what):
    """End the process now, saying why on stderr; no exception the program could catch."""
    os.write(2, f"\nmoeflow sandbox: refused ({kind}): {what}\n".encode("utf-8", "replace"))
    os._exit(EXIT_CODES[kind])


def make_hook(root):
    """The audit hook for a program whose working directory is ``root`` (a resolved path), which it may not
    leave: every relative path is relative to ``root`` then, and a path is inside once its symbolic links
    are resolved. Descriptors of directories outside ``root`` are refused (``dir_fd`` arguments are not in
    the events), and so are new hard links and renames from outside (writing through one would write there)."""
    realpath, join, commonpath, fsdecode, isdir, modules = (
        os.path.realpath,
        os.path.join,
        os.path.commonpath,
        os.fsdecode,
        os.path.isdir,
        sys.modules,
    )

    def resolved(path):
        try:
            return realpath(join(root, fsdecode(path)))
        except (TypeError, ValueError, OSError):
            return None

    def inside(path):
        if isinstance(path, int):  # a descriptor the program holds (stdout, a file it opened): already checked
            return True
        full = resolved(path)
        return full is not None and (full in ALWAYS_WRITABLE or commonpath([full, root]) == root)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & OPEN_WRITE_FLAGS
            )
            if writes and not inside(path):
                refuse("write_outside", f"open({path!r}, {mode or flags!r})")
            if mode is None and not inside(path) and isdir(resolved(path) or ""):
                refuse("forbidden", f"os.open of the directory {path!r} outside the working directory")
        elif event in WRITE_EVENTS:
            paths = args[1:2] if event == "os.symlink" else args[:2] if event in TWO_PATH_EVENTS else args[:1]
            for path in paths:
                if not inside(path):
                    refuse("write_outside", f"{event}({path!r})")
        elif event in PROCESS_EVENTS:
            refuse("fork", event)
        elif event == "import" and args[0] == "_posixsubprocess" and "_posixsubprocess" not in modules:
            refuse("fork", "a fresh import of _posixsubprocess")
        elif event.startswith("socket."):
            refuse("network", event)
        elif event in FORBIDDEN_EVENTS or event.startswith("ctypes."):
            refuse("forbidden", event)

    return hook


def close_process_backdoor():
    """subprocess starts processes through ``_posixsubprocess.fork_exec``, which raises no audit event: the
    module is loaded here with that function refusing (the hook refuses loading it afresh)."""
    import _posixsubprocess

    def fork_exec(*_args):
        refuse("fork", "_posixsubprocess.fork_exec")

    _posixsubprocess.fork_exec = fork_exec


def run_under_init():
    """As the first process of a new PID namespace (``unshare --pid --fork``), fork: the program runs in the
    child, while this process, the namespace's init, waits and exits as the child did (signal N as 128 + N).
    The kernel delivers no signal to an init that has no handler for it (RLIMIT_CPU's SIGXCPU included), and
    when the init exits every process left in the namespace is killed. Returns in the child only."""
    child = os.fork()
    if child == 0:
        return
    _, status = os.waitpid(child, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main(argv):
    limits, program_file = json.loads(argv[1]), argv[2]
    with open(program_file, encoding="utf-8") as fh:
        source = fh.read()
    code = compile(source, "program.py", "exec")
    if os.getpid() == 1:
        run_under_init()
    set_limits(limits)
    close_process_backdoor()
    sys.addaudithook(make_hook(os.path.realpath(os.getcwd())))
    del limits, program_file, source
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except MemoryError:
        os.write(2, b"\nMemoryError (the sandbox's memory limit)\n")
        os._exit(EXIT_CODES["memory"])


if __name__ == "__main__":
    main(sys.argv)
