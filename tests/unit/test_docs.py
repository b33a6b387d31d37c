"""The docs match the tree: PROTOCOL.md's test index names tests that exist (in the files
it names), the paths and ``module.name`` references in the docs exist, README's Layout
names every module, nothing cites a design document outside the repository, and every test
file is in tests/unit or tests/integration.

These are cheap text checks (no imports of the package, no store): they fail when a
test is renamed or moved, a module split or renamed, without the docs following.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for d in here.parents:
        if (d / "pyproject.toml").is_file() and (d / "ddiloco_cli").is_dir():
            return d
    raise AssertionError(f"no repository root above {here}")


REPO = _repo_root()
PROTOCOL = REPO / "protocol" / "PROTOCOL.md"
README = REPO / "README.md"
DOCS = [PROTOCOL, README, *sorted((REPO / "docs").glob("*.md"))]
PACKAGE = REPO / "ddiloco_cli"
PATH_RE = re.compile(r"(?<![\w./-])((?:ddiloco_cli|tests|scripts|examples|protocol|docs)/[\w./*-]*[\w/*])")
TEST_NAME_RE = re.compile(r"\btest_\w+")


def _defined_tests() -> dict[str, set[str]]:
    """{test function name: files (relative) defining it} over every test file under tests/."""
    out: dict[str, set[str]] = {}
    for f in (REPO / "tests").rglob("test_*.py"):
        for name in re.findall(r"^\s*(?:async\s+)?def (test_\w+)\s*\(", f.read_text(encoding="utf-8"), re.M):
            out.setdefault(name, set()).add(f.relative_to(REPO).as_posix())
    return out


def _test_index_rows() -> list[tuple[str, str]]:
    """(ids, tests cell) of every row of PROTOCOL.md's test index."""
    text = PROTOCOL.read_text(encoding="utf-8")
    start = text.index('<a id="test-index"></a>')
    rows = []
    for line in text[start:].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 2 and cells[0] not in ("Id", "---"):
            rows.append((cells[0], cells[1]))
    assert rows, "PROTOCOL.md's test index has no rows"
    return rows


def test_protocol_test_index_names_tests_that_exist_in_the_files_it_names():
    defined = _defined_tests()
    problems = []
    for ids, cell in _test_index_rows():
        files = set(re.findall(r"tests/[\w/]+\.py", cell))
        for f in files:
            if not (REPO / f).is_file():
                problems.append(f"[{ids}] names {f}, which does not exist")
        # the index's default file, and its shorthand for the process-level fencing tests
        candidates = files | {"tests/unit/test_protocol.py"}
        if "fencing_processes" in cell:
            candidates.add("tests/integration/test_fencing_processes.py")
        names = TEST_NAME_RE.findall(re.sub(r"tests/[\w/]+\.py", "", cell))
        assert names or "fencing_processes" in cell, f"[{ids}] names no test"
        for name in names:
            where = defined.get(name, set())
            if not where:
                problems.append(f"[{ids}] names {name}, which no test file defines")
            elif not where & candidates:
                problems.append(f"[{ids}] names {name} as in {sorted(candidates)}, but it is in {sorted(where)}")
    assert not problems, "\n".join(problems)


def test_every_protocol_requirement_id_is_in_the_test_index():
    text = PROTOCOL.read_text(encoding="utf-8")
    declared = set(re.findall(r"\*\*\[([A-Z]\d+)\]", text))
    indexed = {i for ids, _ in _test_index_rows() for i in re.findall(r"[A-Z]\d+", ids)}
    assert declared, "no requirement ids found in PROTOCOL.md"
    assert not declared - indexed, f"requirement ids without a test in the index: {sorted(declared - indexed)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_paths_named_in_the_docs_exist(doc):
    missing = []
    for path in sorted(set(PATH_RE.findall(doc.read_text(encoding="utf-8")))):
        path = path.split("::")[0]
        if "*" in path:  # a pattern (scripts/bench_*.py)
            continue
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def _module_files() -> dict[str, Path]:
    """{module stem: file} of the package's modules (and the learner package's)."""
    files = [*PACKAGE.glob("*.py"), *(PACKAGE / "learner").glob("*.py"), *(PACKAGE / "store").glob("*.py")]
    return {f.stem: f for f in files if not f.stem.startswith("__")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_dot_name_references_in_the_docs_exist(doc):
    """`replay.restore_value`, `records.parse_json`, ...: the module exists and defines the name."""
    modules = _module_files()
    missing = []
    for mod, name in sorted(set(re.findall(r"`(?:ddiloco_cli\.)?([a-z_]+)\.([A-Za-z_]\w*)(?:\(\))?`",
                                            doc.read_text(encoding="utf-8")))):
        if mod not in modules or name in ("py", "md", "json", "sh", "toml", "yaml"):
            continue  # not one of ours (e.g. `torch.load`), or a file name
        src = modules[mod].read_text(encoding="utf-8")
        if not re.search(rf"^\s*(?:def|class|async def) {name}\b|^\s*(?:self\.)?{name}\s*[:=]", src, re.M):
            missing.append(f"{mod}.{name}")
    assert not missing, f"{doc.relative_to(REPO)} names what its module does not define: {missing}"


def test_readme_layout_names_every_module():
    text = README.read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    layout = layout[layout.index("```") + 3:]
    layout = layout[:layout.index("```")]
    expected = [f for f in sorted(PACKAGE.rglob("*.py")) if not f.stem.startswith("__")]
    expected += [d for d in sorted(PACKAGE.iterdir()) if (d / "__init__.py").exists()]  # each subpackage
    missing = [f.relative_to(REPO).as_posix() for f in expected if not re.search(rf"\b{re.escape(f.name)}\b", layout)]
    assert len(expected) > 60
    assert not missing, f"README's Layout does not name: {missing}"


def test_every_test_file_is_in_unit_or_integration_and_imports_no_other_test_file():
    """tests/unit (in one process) or tests/integration (servers, processes); shared helpers
    live in tests/support and tests/conftest.py, never in a test module another one imports."""
    tests = REPO / "tests"
    misplaced, cross = [], []
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(REPO).as_posix()
        if f.parent not in (tests / "unit", tests / "integration"):
            misplaced.append(rel)
        if re.search(r"^\s*(?:from\s+(?:tests\.)?test_\w+\s+import|import\s+(?:tests\.)?test_\w+)",
                     f.read_text(encoding="utf-8"), re.M):
            cross.append(rel)
    assert not misplaced, f"test files outside tests/unit and tests/integration: {misplaced}"
    assert not cross, f"test modules that import another test module (use tests/support): {cross}"


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        return [REPO / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the source directories
        tops = ("ddiloco_cli", "tests", "scripts", "docs", "protocol", "examples")
        return [p for t in tops for p in (REPO / t).rglob("*") if p.is_file()] + list(REPO.glob("*.*"))


def test_no_file_cites_a_design_document_outside_the_repository():
    design, shared = "DESIGN" + ".md", ".." + "/shared"  # spelled apart so this file does not match itself
    hits = []
    for f in _tracked_files():
        if not f.is_file():
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (a png)
        if design in text or shared in text:
            hits.append(f.relative_to(REPO).as_posix())
    assert not hits, f"these files cite a design document that is not in the repository: {hits}"
    assert (REPO / "docs" / "design.md").is_file(), "docs/design.md (the design as built) is missing"
