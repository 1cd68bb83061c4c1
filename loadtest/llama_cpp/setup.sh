#!/bin/sh
# llama.cpp as a peer to measure against: llama-cpp-python (its bindings and llama-server-like
# `python -m llama_cpp.server`) built from its PyPI sdist into a virtualenv outside the repo, once.
# The build compiles llama.cpp for this CPU (GGML_NATIVE): about 20 minutes on 2 cores.
#
#   sh loadtest/llama_cpp/setup.sh            # prints the virtualenv's python when done
#   LLAMA_CPP_VERSION=0.3.36 LLAMA_CPP_HOME=~/.cache/pagedserve/llama-cpp sh loadtest/llama_cpp/setup.sh
set -eu
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
HOME_DIR=${LLAMA_CPP_HOME:-$HOME/.cache/pagedserve/llama-cpp}
VENV=$HOME_DIR/venv-$VERSION
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
mkdir -p "$HOME_DIR"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
echo "building llama-cpp-python $VERSION from its sdist (about 20 minutes on 2 cores) ..." >&2
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$VENV/bin/pip" install --no-binary llama-cpp-python "llama-cpp-python[server]==$VERSION" >&2
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" >&2
echo "$VENV/bin/python"
