#!/usr/bin/env bash
# Builds the project's Dockerfile without a Docker engine or a registry, for the cluster tests:
#   1. a Debian bookworm base with Python, made once with debootstrap (stands in for python:3.11-slim-bookworm);
#   2. the Dockerfile itself with buildah (chroot isolation), on that base, with the CPU torch wheel given to
#      pip from a local index mounted into the build (the PyTorch index is not reachable here), the rest from PyPI;
#   3. a docker-archive of the image, named as the chart names it, for `ctr images import`.
# Cached: an unchanged build context reuses buildah's layers and the archive. Needs root and Debian (apt).
# Usage: scripts/kube/image.sh   (prints the archive's path; its image ID is in the file beside it, .id)
set -euo pipefail
cd "$(dirname "$0")/../.."

cache="${RLFLEET_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlfleet/image}"
image="${RLFLEET_IMAGE:-ghcr.io/rlfleet/rlfleet:0.1.0-cpu}"
base=localhost/rlfleet-base:bookworm
archive="$cache/rlfleet.tar"
buildah=(buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver overlay)
log() { echo "rlfleet image: $*" >&2; }
# shellcheck source=packages.sh
source scripts/kube/packages.sh

build_base() {
  # What the Dockerfile needs of python:3.11-slim-bookworm: `python`, venv with pip, the Python headers (torch
  # inductor compiles against them at run time), CA certificates, apt.
  "${buildah[@]}" inspect --type image "$base" >/dev/null 2>&1 && return
  log "making $base with debootstrap"
  local root="$cache/base-root"
  rm -rf "$root"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,python-is-python3,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >/dev/null
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
  # The base trusts what this machine trusts (its bundle may hold a TLS-intercepting proxy's CA), pip included.
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  local container
  container=$("${buildah[@]}" from scratch)
  tar -C "$root" -cf "$cache/base-root.tar" .
  "${buildah[@]}" add "$container" "$cache/base-root.tar" /
  "${buildah[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --cmd python3 "$container"
  "${buildah[@]}" commit -q "$container" "$base" >/dev/null
  "${buildah[@]}" rm "$container" >/dev/null
  rm -rf "$root" "$cache/base-root.tar"
}

torch_index() {
  # A one-project index (<index>/torch/) holding the CPU wheel this machine's pip can get, mounted into the
  # build: a fixed file:// URL, so the build argument and buildah's layer cache stay the same run to run.
  local index="$cache/torch-index" wheel
  mkdir -p "$index/torch"
  [ -n "$(ls "$index/torch"/*.whl 2>/dev/null)" ] ||
    .venv/bin/pip download -q --no-deps "torch==2.13.0+cpu" -d "$index/torch"
  wheel=$(basename "$(ls "$index/torch"/*.whl | head -1)")
  echo "<html><body><a href=\"$wheel\">$wheel</a></body></html>" >"$index/torch/index.html"
}

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
ensure_packages buildah debootstrap
# Cold: the build's layers, its archive and the node's copy of it (~14 GiB); after that, a new top layer.
if "${buildah[@]}" inspect --type image "$image" >/dev/null 2>&1; then ensure_space 4 "$cache"; else ensure_space 16 "$cache"; fi
build_base
torch_index
# A build that was killed leaves its working container (and the layers under it) behind.
"${buildah[@]}" rm --all >/dev/null
started=$SECONDS
# Build arguments only: the same Dockerfile users build, with their defaults left as they are.
"${buildah[@]}" bud -q --isolation chroot --layers --network host --volume "$cache/torch-index:/torch-index:ro" \
  --build-arg BASE_IMAGE="$base" \
  --build-arg TORCH_CPU_INDEX=file:///torch-index/ \
  --build-arg PIP_EXTRA_INDEX_URL=https://pypi.org/simple \
  -t "$image" -f Dockerfile . >"$cache/build.log" 2>&1 || { tail -40 "$cache/build.log" >&2; exit 1; }
# What earlier builds left, untagged by this one. The image's own layers (its dependencies, 3 GB, included)
# stay, for the next build to reuse.
"${buildah[@]}" rmi --prune >/dev/null
id=$("${buildah[@]}" inspect --type image --format '{{.FromImageID}}' "$image")
if [ ! -e "$archive" ] || [ "$(cat "$archive.id" 2>/dev/null)" != "$id" ]; then
  rm -f "$archive" "$archive.id"
  "${buildah[@]}" push -q "$image" "docker-archive:$archive.part:$image" >/dev/null
  mv "$archive.part" "$archive"
  echo "$id" >"$archive.id"
  log "built $image ($id) in $((SECONDS - started)) s"
fi
echo "$archive"
