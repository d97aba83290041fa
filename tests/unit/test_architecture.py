"""Rules of the code's shape that no single behaviour test sees: one door to a model, defaults applied in one
place, no private names borrowed across modules, modules of a readable size, each module saying what it is (the
module map of docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import module_map

from moeflow.settings import REPO_ROOT

PACKAGE = REPO_ROOT / "src" / "moeflow"
CODE = sorted(
    [
        *PACKAGE.rglob("*.py"),
        *(REPO_ROOT / "tests").rglob("*.py"),
        *(REPO_ROOT / "benchmarks").glob("*.py"),
        *(REPO_ROOT / "tools").glob("*.py"),
        *(REPO_ROOT / "workflow" / "scripts").glob("*.py"),
    ]
)
FACTORY = PACKAGE / "loading" / "factory.py"
# Modules that build a model on the meta device only to read it (one MoE block to time, parameters to count):
# through the factory's class, never a model anything trains or evaluates.
SKELETONS = {PACKAGE / "model" / "experts_choice.py", PACKAGE / "plan" / "counts.py"}
# measures transformers' own from_pretrained against the factory's load: the one script that calls it
TRANSFORMERS_LOAD_BENCHMARK = REPO_ROOT / "benchmarks" / "load_memory.py"
MAX_LINES = 600
# The project's own modules: the package, the benchmarks, the tests' shared helpers (tests/*.py).
OWN = ("moeflow", "benchmarks", *(p.stem for p in (REPO_ROOT / "tests").glob("*.py")))


def tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def relative(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def private_imports(path: Path) -> list[str]:
    """``from moeflow... import _name`` (and from the benchmarks and the tests' shared modules)."""
    return [
        f"{relative(path)}:{node.lineno}: from {node.module} import {alias.name}"
        for node in ast.walk(tree(path))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OWN
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def model_constructions(path: Path) -> list[str]:
    """Calls of ``from_pretrained``/``from_config``/``_from_config`` on a causal-LM class (transformers' auto class
    or the factory's ``causal_lm_class()``)."""
    found = []
    for node in ast.walk(tree(path)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("from_pretrained", "from_config", "_from_config"):
            continue
        receiver = ast.unparse(node.func.value)
        if "CausalLM" in receiver or "causal_lm_class" in receiver:
            found.append(f"{relative(path)}:{node.lineno}: {receiver}.{node.func.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    assert [line for path in CODE for line in private_imports(path)] == []


def _from_pretrained_lines(path: Path) -> list[int]:
    return [
        i for i, line in enumerate(path.read_text().splitlines(), 1) if "causal_lm_class().from_pretrained(" in line
    ]


def test_the_factory_is_the_one_place_models_are_built_and_loaded():
    """Stage scripts, benchmarks and the library go through moeflow.loading.factory.make_model; tests may reload an
    export with transformers to check it."""
    library = [p for p in PACKAGE.rglob("*.py") if p not in SKELETONS | {FACTORY}]
    scripts = [*(REPO_ROOT / "workflow" / "scripts").glob("*.py"), *(REPO_ROOT / "benchmarks").glob("*.py")]
    assert [line for path in library + scripts for line in model_constructions(path)] == [
        f"{relative(TRANSFORMERS_LOAD_BENCHMARK)}:{line}: causal_lm_class().from_pretrained"
        for line in _from_pretrained_lines(TRANSFORMERS_LOAD_BENCHMARK)
    ]
    assert model_constructions(FACTORY)  # what the rule above looks for is how the factory does it
    for path in SKELETONS:
        assert all("causal_lm_class().from_config" in line for line in model_constructions(path)), path


def opening(path: Path) -> list[str]:
    """A stage script's first two statements after its imports, as source."""
    docstring = ast.Expr(ast.Constant(ast.get_docstring(tree(path), clean=False)))
    skipped = {ast.dump(docstring)}
    body = [
        n for n in tree(path).body if not isinstance(n, (ast.Import, ast.ImportFrom)) and ast.dump(n) not in skipped
    ]
    return [ast.unparse(node) for node in body[:2]]


def test_every_stage_script_opens_with_its_typed_settings_and_the_shared_start():
    """``job = Job.from_snakemake(snakemake, XStage)`` (a ``script:`` rule) or ``Job.from_argv(XStage)`` (torchrun),
    then ``Stage.start(job)``: every stage's settings are a typed class, built in one place."""
    scripts = sorted((REPO_ROOT / "workflow" / "scripts").glob("*.py"))
    bad = []
    for path in scripts:
        first, second = opening(path)
        typed_job = first.startswith("job = Job.from_snakemake(snakemake, ") or first.startswith("job = Job.from_argv(")
        if not (typed_job and first.endswith(")") and first.count(",") <= 1 and "Stage.start(job)" in second):
            bad.append(f"{relative(path)}: {first} / {second}")
    assert len(scripts) == 20 and bad == []


def test_schema_defaults_are_filled_only_where_the_config_is_loaded():
    """``with_defaults`` belongs to moeflow.settings (``typed`` fills the keys a test leaves out) and
    moeflow.workflow (the merged config); the library reads typed settings or whole sections."""
    allowed = {PACKAGE / "settings.py", *(PACKAGE / "workflow").glob("*.py")}
    calls = [
        f"{relative(path)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path not in allowed
        for node in ast.walk(tree(path))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("with_defaults")
    ]
    assert calls == []


def test_no_library_module_is_over_600_lines():
    sizes = {relative(p): len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def restates(first: str, body: str) -> bool:
    """Whether a docstring's body opens by saying its first line again (its first four words, or all of it)."""
    first, body = first.strip().rstrip("."), " ".join(body.split())
    return body.startswith(first) or (len(first.split()) >= 4 and body.split()[:4] == first.split()[:4])


def test_every_module_has_a_docstring_whose_first_line_says_what_it_is():
    """A sentence of its own on the first line (the module map shows it), the details after a blank line, which
    do not say the first line again."""
    bad = []
    for path in module_map.modules():
        lines = (module_map.docstring(path) or "").splitlines()
        if not lines or not lines[0].strip():
            bad.append(f"{relative(path)}: no docstring")
        elif not lines[0].rstrip().endswith(".") or (len(lines) > 1 and lines[1].strip()):
            bad.append(f"{relative(path)}: the first line is not a sentence of its own: {lines[0]!r}")
        elif restates(lines[0], " ".join(lines[2:])):
            bad.append(f"{relative(path)}: the body opens by saying the first line again")
    assert bad == []


def test_a_body_that_says_the_first_line_again_is_caught():
    first = "The tokenize stage: one corpus read, split, encoded and packed."
    assert restates(first, "The tokenize stage: one corpus read, split, encoded and packed, with its manifest.")
    assert not restates(first, "Each split is written with its manifest.json.")


def test_the_module_map_is_the_docstrings():
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert module_map.with_table(doc) == doc, (
        "docs/architecture.md's module map is out of date: run tests/module_map.py"
    )
    rows = doc.split(module_map.TABLE_START)[1].split(module_map.TABLE_END)[0]
    assert len(module_map.modules()) > 90 and all(
        f"| `{module_map.dotted_name(p)}` |" in rows for p in PACKAGE.rglob("*.py")
    )
