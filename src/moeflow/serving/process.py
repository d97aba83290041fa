"""Running moeflow.serving.engine in the serving environment's Python (``serve.python``): its record, or its error.

The serving environment has its own pins (envs/serve.txt) and no moeflow: the engine file runs there as a script,
with nothing of this process's Python path.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENGINE_SCRIPT = Path(__file__).with_name("engine.py")


class EngineError(RuntimeError):
    """The serving engine could not run, or could not load what it was given; the message says why."""


class ServeCheckError(EngineError):
    """An export or adapter that does not serve as trained; the message says what differs and what to do."""


def run_engine(
    python: str | os.PathLike,
    model_dir: str | os.PathLike,
    args: Sequence[str],
    timeout_s: float,
    threads: int = 1,
    request: tuple[str, Any] | None = None,
) -> dict[str, Any]:
    """moeflow.serving.engine run by the serving environment's ``python`` on ``model_dir`` with ``args``: its JSON
    record, or a EngineError with the end of its output. ``request``: (flag, value), the value written as JSON to a
    file beside the record and passed as ``flag FILE``."""
    if python is None:
        raise EngineError(
            "config key 'serve.python' is null: make the serving environment (`make serve-env`) and "
            "pass --configfile config/serve.yaml"
        )
    python = Path(python)
    if not python.is_file():
        raise EngineError(
            f"config key 'serve.python': {python} does not exist: make the serving environment with `make serve-env` "
            "(it writes .venvs/serve), or point the key at a Python with vLLM installed"
        )
    with tempfile.TemporaryDirectory(prefix="moeflow-serve-") as tmp:
        result = Path(tmp) / "engine.json"
        if request is not None:
            flag, value = request
            given = Path(tmp) / "request.json"
            given.write_text(json.dumps(value))
            args = [*args, flag, str(given)]
        # -I: none of this process's paths, nor the engine file's folder (moeflow's modules) on its import path
        command = [str(python), "-I", str(ENGINE_SCRIPT), "--model", str(model_dir), "--output", str(result), *args]
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise EngineError(f"the engine took longer than serve.timeout_s ({timeout_s} s) on {model_dir}") from None
        log.info("engine output:\n%s", done.stdout[-4000:] + done.stderr[-8000:])
        if done.returncode != 0:
            raise EngineError(
                f"vLLM could not serve {model_dir} (exit {done.returncode}); the end of its output:\n"
                + _last_lines(done.stdout + done.stderr)
            )
        if not result.is_file():
            raise EngineError(f"the engine exited without its record on {model_dir}:\n" + _last_lines(done.stderr))
        return json.loads(result.read_text())


def _last_lines(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
