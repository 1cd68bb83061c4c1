"""Our ``kernels/`` package beside Hugging Face's ``kernels`` distribution (which transformers 5.25
and later require; same top-level name): with transformers' hub kernels off
(``shared/hub_kernels.py``) transformers loads models, and ``import kernels`` is ours."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A tiny Llama through transformers' own loading path (its model classes import the hub
# integration), then our kernels package.
LOAD = textwrap.dedent("""
    import os, sys, tempfile
    if sys.argv[1] == "guarded":
        from shared.hub_kernels import hide_hub_kernels
        assert hide_hub_kernels() is True and os.environ["USE_HUB_KERNELS"] == "NO"
    elif sys.argv[1] == "offline":  # a user's script: the offline engine first, then transformers' models
        from services.offline import LLM
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import import_utils
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    with tempfile.TemporaryDirectory() as directory:
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory)
    import kernels, kernels.reference
    print("loaded", type(model).__name__, import_utils.is_kernels_available(), kernels.reference.__file__)
""")


def _fake_hub_kernels(tmp_path: Path) -> Path:
    """A directory that makes Hugging Face's ``kernels`` distribution look installed, at the lowest
    version this transformers takes (its metadata only: the import name stays ours)."""
    from transformers.utils import import_utils

    version = getattr(import_utils, "KERNELS_MIN_VERSION", "0.19.1")
    info = tmp_path / f"kernels-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    return tmp_path


def _load(mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "USE_HUB_KERNELS"}  # as a new shell's
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(_fake_hub_kernels(tmp_path))])
    return subprocess.run([sys.executable, "-c", LOAD, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # a fresh process loads transformers' model code
def test_with_hub_kernels_off_transformers_loads_a_model_beside_hugging_faces_kernels(tmp_path):
    done = _load("guarded", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["loaded", "LlamaForCausalLM", "False", str(ROOT / "kernels" / "reference.py")]


@pytest.mark.slow  # a fresh process loads the engine and transformers' model code
def test_a_script_that_imports_the_offline_engine_first_uses_transformers_as_it_likes(tmp_path):
    done = _load("offline", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[:3] == ["loaded", "LlamaForCausalLM", "False"]


@pytest.mark.slow  # a fresh process loads transformers' model code
def test_without_it_the_clash_is_there(tmp_path):
    """The same load without ``hide_hub_kernels``: transformers finds the distribution, imports
    ``kernels`` for its hub integration, gets ours, and fails (what the test above is guarded
    against; if this passes no longer, transformers changed how it imports ``kernels``)."""
    done = _load("unguarded", tmp_path)
    assert done.returncode != 0 and "cannot import name" in done.stderr and "from 'kernels'" in done.stderr, (
        done.stdout + done.stderr[-3000:])


def test_in_this_process_transformers_takes_hub_kernels_as_unavailable():
    """tests/__init__.py turned them off before any test imported transformers; a second call is
    free and says so."""
    import transformers.utils
    from transformers.utils import import_utils

    from shared.hub_kernels import hide_hub_kernels

    assert hide_hub_kernels() is True
    assert os.environ["USE_HUB_KERNELS"] == "NO"  # transformers' own switch: from_pretrained kernelizes nothing
    assert import_utils.is_kernels_available() is False and transformers.utils.is_kernels_available() is False
    import transformers.integrations.hub_kernels  # noqa: F401  (imports nothing from kernels now)
    import kernels.reference

    assert Path(kernels.reference.__file__) == ROOT / "kernels" / "reference.py"



def _imports_before_the_switch(source: str) -> list[int]:
    """The lines of each transformers import in ``source`` with no ``hide_hub_kernels()`` call
    before it in the same function (or at module level)."""
    import ast

    tree = ast.parse(source)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    owner = {}  # node -> innermost scope (outer scopes come first; inner ones overwrite)
    for scope in scopes:
        for node in ast.walk(scope):
            owner[node] = scope
    missing = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if not any(name == "transformers" or name.startswith("transformers.") for name in names):
            continue
        calls = [c.lineno for c in ast.walk(owner[node]) if isinstance(c, ast.Call)
                 and getattr(c.func, "id", getattr(c.func, "attr", None)) == "hide_hub_kernels"]
        if not any(line < node.lineno for line in calls):
            missing.append(node.lineno)
    return sorted(missing)


def test_the_import_checker_sees_a_missing_or_late_switch():
    source = textwrap.dedent("""
        def good():
            hide_hub_kernels()
            from transformers import AutoConfig
        def late():
            import transformers.utils
            hide_hub_kernels()
        def nested():
            hide_hub_kernels()
            def inner():
                from transformers import AutoTokenizer
    """)
    assert _imports_before_the_switch(source) == [6, 11]


def test_every_transformers_import_of_the_product_and_load_tests_turns_hub_kernels_off_first():
    """A code path that imports transformers calls ``hide_hub_kernels()`` before, in the same
    function (the tests' own imports come after tests/__init__.py's call)."""
    paths = [p for top in ("services", "shared", "loadtest") for p in sorted((ROOT / top).rglob("*.py"))]
    sources = {p: p.read_text(encoding="utf-8") for p in paths}
    importing = [p for p, text in sources.items() if "transformers" in text and p != ROOT / "shared" / "hub_kernels.py"]
    assert len(importing) > 5
    missing = [f"{p.relative_to(ROOT)}:{line}" for p in importing for line in _imports_before_the_switch(sources[p])]
    assert not missing, "transformers imported before hide_hub_kernels():\n" + "\n".join(missing)
