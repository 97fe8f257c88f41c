"""The house rules a reader can check with `git ls-files`, `wc -l` and the imports.

- Every import points down engine -> executor -> worker -> model_loader -> models ->
  distributed -> config, typing-only and function-local imports included; within a
  layer, no module reaches itself through its imports (no circle).
- No Python file outside tests/ is over 400 lines.
- README.md is a newcomer's page of at most 200 lines.
- docs/design.md's module map names every runtime module, and every module it names exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["engine", "executor", "worker", "model_loader", "models", "distributed", "config"]
MAX_LINES = 400
MAX_README_LINES = 200


def tracked(pattern: str) -> list[Path]:
    """The checkout's files matching `pattern`: tracked, or new and not ignored."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", pattern],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines() if (REPO / line).is_file()]


def runtime_modules() -> list[Path]:
    return [p for p in tracked("*.py") if p.relative_to(REPO).parts[0] in LAYERS]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_every_import_points_down_the_layers() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in runtime_modules():
        layer = path.relative_to(REPO).parts[0]
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in rank and rank[top] < rank[layer]:
                upward.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, names: set[str]) -> set[str]:
    """The runtime modules `path` imports, anywhere in it: `from pkg import sub` counts as
    importing the submodule (the package's own __init__ runs first in any case)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & names
            found |= subs or {node.module}
    return found & names


def test_no_import_circle() -> None:
    paths = {module_name(p): p for p in runtime_modules()}
    names = set(paths)
    graph = {name: module_imports(path, names) - {name} for name, path in paths.items()}
    circles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circles.append(" -> ".join(trail[trail.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, trail + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles (typing-only and function-local imports count):\n" + "\n".join(circles)


def test_the_runtime_never_imports_transformers_or_the_scripts() -> None:
    bad = [f"{p.relative_to(REPO)}:{line} imports {m}" for p in runtime_modules()
           for line, m in imported_modules(p) if m.split(".")[0] in ("transformers", "scripts", "tests")]
    assert not bad, "\n".join(bad)


def test_no_python_file_outside_tests_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in tracked("*.py")
            if p.relative_to(REPO).parts[0] != "tests" and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_readme_is_a_newcomers_page() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    # The set-up, the demo and the test command are on it, and it links the design.
    assert "pip install torch==2.13.0" in text and "python -m engine.serve" in text
    assert re.search(r"## Test\s+```bash\s+python3 -m pytest -q\s+```", text)
    assert "docs/design.md" in text


def test_design_module_map_matches_the_code() -> None:
    """Every runtime module and C kernel is named in docs/design.md, by its path or a tail
    of it (`openai/app.py`, `backends/cpu_attn.py`, or a bare name where it is unique),
    and every path the page names exists."""
    design = (REPO / "docs" / "design.md").read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_0-9]+\.(?:py|c))`", design))
    files = {str(p.relative_to(REPO)) for p in runtime_modules() if p.name != "__init__.py"}
    files |= {str(p.relative_to(REPO)) for p in tracked("*.c")}

    def names(path: str) -> bool:
        return any(path == n or path.endswith("/" + n) for n in named)

    missing = sorted(f for f in files if not names(f))
    assert not missing, f"runtime modules docs/design.md does not name: {missing}"
    everything = {str(p.relative_to(REPO)) for p in tracked("*")}
    stale = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in everything))
    assert not stale, f"docs/design.md names files that do not exist: {stale}"
