"""The architecture's import arrows (``/work/shared/DESIGN.md``, "Processes" and "Kernels"), read from
the source with ``ast``: every ``import`` and ``from ... import`` of every ``.py`` file under
``services/``, ``shared/`` and ``kernels/``, those inside functions too, relative ones resolved
(and ``importlib.import_module("...")`` with a literal name). A violation is reported as
``file:line: what it imports``.

- A process package (each package directly under ``services/``: ``frontend``, ``scheduler``,
  ``executor``) imports from the project only itself and ``shared`` (the wire protocol and what the
  processes share); the executor, and it alone, also imports ``kernels`` (the frontend never
  touches tensors; the scheduler is plain Python). No process imports another, and none imports the
  modules at the top of ``services/`` (``cli``, ``launcher``, ``offline``, ``children``...): those
  are the layer that starts or composes the processes (the launcher starts all three, the offline
  ``LLM`` runs a scheduler and an executor in one process), so they may import any process
  package, never the other way round. Something two processes need goes to ``shared/``.
- ``shared/`` imports no process and no kernel.
- ``kernels/`` imports only numba, numpy, torch, the standard library and itself (what it needs
  from the executor or ``shared`` is passed in: ``NumbaCPUBackend(native_bf16=...,
  idle_threads_spin=...)``), with the two parts of numba's own toolchain named in
  ``KERNEL_TOOLCHAIN``.
- None of the three imports ``loadtest`` or ``tests`` (they import the product, not the reverse).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("services", "shared", "kernels", "loadtest", "tests")  # the project's top-level packages

# Beside numba, numpy and torch, what kernels/ may import, and why.
KERNEL_TOOLCHAIN = {
    "llvmlite": "numba's own code generator (a dependency of numba): the ``@intrinsic`` bodies of "
                "kernels/cpu/ (vectors, tiles, matmul, common) and kernels/cuda/config.py build its IR",
    "nvidia": "the namespace of NVIDIA's CUDA toolchain wheels that numba-cuda compiles with "
              "(nvidia-cuda-nvcc): kernels/cuda/resources.py finds ``ptxas`` there, guarded",
}
KERNEL_IMPORTS = {"numba", "numpy", "torch", "kernels", *KERNEL_TOOLCHAIN}


def module_name(path: Path) -> str:
    """``services/executor/loader.py`` -> ``services.executor.loader``; a package's
    ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every module ``source`` (the text of ``module``) imports, anywhere
    in it. ``from a.b import c`` gives ``a.b.c`` (``c`` may be a module: ``from services import
    frontend``); relative imports are resolved against ``module``'s package."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            for alias in node.names:
                found.append((node.lineno, stem if alias.name == "*" else f"{stem}.{alias.name}"))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            found.append((node.lineno, node.args[0].value))
    return sorted(found, key=lambda item: item[0])


def _sources(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def _all_imports(top: str):
    for path in _sources(top):
        for line, name in imports(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py"):
            yield f"{path.relative_to(ROOT)}:{line}", path, name


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _report(violations: list[str]) -> str:
    return f"{len(violations)} import(s) break the architecture's arrows:\n" + "\n".join(violations)


def process_packages() -> list[str]:
    return sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())


def test_the_scanner_sees_every_kind_of_import():
    """What the arrow tests rely on: imports in functions, relative ones at each level, ``from
    package import module`` and ``import_module`` are all found and resolved."""
    source = (
        "import os\n"
        "from . import sibling\n"
        "from .attention import select_backend\n"
        "from ..frontend import app\n"
        "def late():\n"
        "    from services import scheduler\n"
        "    import importlib\n"
        "    return importlib.import_module('kernels.cpu')\n"
    )
    got = imports(source, "services.executor.loader")
    assert got == [(1, "os"), (2, "services.executor.sibling"), (3, "services.executor.attention.select_backend"),
                   (4, "services.frontend.app"), (6, "services.scheduler"), (7, "importlib"), (8, "kernels.cpu")]
    assert imports("from . import x\n", "services.executor.parallel", is_package=True) == [
        (1, "services.executor.parallel.x")]


def test_the_processes_import_only_themselves_shared_and_for_the_executor_kernels():
    processes = process_packages()
    assert {"frontend", "scheduler", "executor"} <= set(processes)  # what DESIGN.md names
    violations = []
    for process in processes:
        own = f"services.{process}"
        scanned = 0
        for where, path, name in _all_imports(f"services/{process}"):
            scanned += 1
            if name.split(".")[0] not in PROJECT or _within(name, own) or _within(name, "shared"):
                continue
            if _within(name, "kernels") and process == "executor":
                continue
            if _within(name, "services"):
                other = name.split(".")[1] if "." in name else ""
                why = (f"another process ({other})" if other in processes
                       else "the launch/compose layer at the top of services/ (move what is shared to shared/)")
            elif _within(name, "kernels"):
                why = "kernels (only the executor runs them)"
            else:
                why = "test or load-test code"
            violations.append(f"{where}: {own} imports {name}: {why}")
        assert scanned > 0, f"no imports found under services/{process}"
    assert not violations, _report(violations)


def test_shared_imports_no_process_and_no_kernel():
    violations = [f"{where}: shared imports {name}" for where, _, name in _all_imports("shared")
                  if name.split(".")[0] in ("services", "kernels", "loadtest", "tests")]
    assert len(_sources("shared")) > 5
    assert not violations, _report(violations)


def test_kernels_import_only_numba_numpy_torch_and_the_standard_library():
    allowed = KERNEL_IMPORTS | set(sys.stdlib_module_names)
    violations = [f"{where}: kernels imports {name}" for where, _, name in _all_imports("kernels")
                  if name.split(".")[0] not in allowed]
    assert len(_sources("kernels")) > 10
    assert not violations, _report(violations)


def test_the_top_of_services_imports_no_test_or_load_test_code():
    """The launch/compose modules (cli, launcher, offline...) may import any process package, but
    not the project's tests or load tests."""
    top = [p for p in _sources("services") if p.parent == ROOT / "services"]
    violations = []
    for path in top:
        for line, name in imports(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py"):
            if name.split(".")[0] in ("loadtest", "tests"):
                violations.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert len(top) > 3
    assert not violations, _report(violations)
