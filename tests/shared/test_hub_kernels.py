"""Our ``kernels/`` package beside Hugging Face's ``kernels`` distribution (which transformers 5.25
and later require; same top-level name): with transformers' hub kernels off
(``shared/hub_kernels.py``) transformers loads models, and ``import kernels`` is ours."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A tiny Llama through transformers' own loading path (its model classes import the hub
# integration), then our kernels package.
LOAD = textwrap.dedent("""
    import os, sys, tempfile
    if sys.argv[1] == "guarded":
        from shared.hub_kernels import hide_hub_kernels
        assert hide_hub_kernels() is True and os.environ["USE_HUB_KERNELS"] == "NO"
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


def test_with_hub_kernels_off_transformers_loads_a_model_beside_hugging_faces_kernels(tmp_path):
    done = _load("guarded", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["loaded", "LlamaForCausalLM", "False", str(ROOT / "kernels" / "reference.py")]


def test_without_it_the_clash_is_there(tmp_path):
    """The same load without ``hide_hub_kernels``: transformers finds the distribution, imports
    ``kernels`` for its hub integration, gets ours, and fails (what the test above is guarded
    against; if this passes no longer, transformers changed how it imports ``kernels``)."""
    done = _load("unguarded", tmp_path)
    assert done.returncode != 0 and "cannot import name" in done.stderr and "from 'kernels'" in done.stderr, (
        done.stdout + done.stderr[-3000:])


def test_in_this_process_transformers_takes_hub_kernels_as_unavailable():
    """tests/conftest.py turned them off before any test imported transformers; a second call is
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
