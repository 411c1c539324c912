#!/usr/bin/env bash
# Builds a one-node Kubernetes from Debian's packages, once, into a cache outside the checkout:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy from the source package
#   `kubernetes` (bookworm: 1.20.2, the newest server any reachable registry has), and the pod sandbox
#   ("pause") image. Installs the node's runtime too: etcd, containerd, runc, CNI plugins, iptables, dnsmasq.
# Cached: a second run only checks the Debian packages (seconds). ~10 minutes cold on 2 cores.
# Needs root and Debian bookworm (apt). Usage: scripts/kube/build.sh   (prints the cache's bin directory)
set -euo pipefail

cache="${RLFLEET_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlfleet/kubernetes}"
version=v1.20.2
out="$cache/$version"
commands=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
log() { echo "rlfleet kube: $*" >&2; }
# shellcheck source=packages.sh
source "$(dirname "$0")/packages.sh"

install_packages() {
  ensure_packages golang-go dpkg-dev make gcc libc6-dev etcd-server containerd runc containernetworking-plugins \
    iptables conntrack dnsmasq-base rsync golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
}

fetch_source() {
  # Bookworm's source package is the full upstream tree with vendor/ (trixie's is a kubectl-only repack).
  local list=/etc/apt/sources.list.d/rlfleet-kubernetes-src.sources
  if [ ! -e "$list" ]; then
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n%s\n' \
      'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' >"$list"
    apt_locked apt-get update -qq
  fi
  rm -rf "$work" && mkdir -p "$work/dl"
  (cd "$work/dl" && apt_locked apt-get source -qq --download-only kubernetes/bookworm 2>/dev/null)
  # apt checked the files against the signed Release already.
  dpkg-source --no-check -x "$work"/dl/kubernetes_*.dsc "$tree" >/dev/null
  # The vendored reflect2 1.0.1 and json-iterator 1.1.10 crash under Go >= 1.18 (the apiserver dies with
  # "unexpected fault address" on the first custom-resource POST): use Debian's fixed versions.
  local gocode=/usr/share/gocode/src/github.com
  for dir in modern-go/reflect2 json-iterator/go; do
    rm -rf "$tree/vendor/github.com/$dir"
    cp -r "$gocode/$dir" "$tree/vendor/github.com/$dir"
    find "$tree/vendor/github.com/$dir" -name '*_test.go' -delete
  done
}

build_binaries() {
  # GOPATH mode: module mode fails on this tree ("updates to go.mod needed").
  export GOPATH="$work/gopath" GOCACHE="$work/gocache" GO111MODULE=off CGO_ENABLED=0
  mkdir -p "$GOPATH/src/k8s.io"
  ln -sfn "$tree" "$GOPATH/src/k8s.io/kubernetes"
  cd "$GOPATH/src/k8s.io/kubernetes"
  # The generated OpenAPI definitions are not in the tarball.
  make gen_openapi >/dev/null
  local flags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    # Without these, clients see the server as v0.0.0.
    flags+=" -X k8s.io/kubernetes/vendor/$pkg.gitVersion=$version -X k8s.io/kubernetes/vendor/$pkg.gitMajor=1"
    flags+=" -X k8s.io/kubernetes/vendor/$pkg.gitMinor=20 -X k8s.io/kubernetes/vendor/$pkg.gitTreeState=clean"
  done
  mkdir -p "$work/bin"
  go build -trimpath -ldflags "$flags" -o "$work/bin/" "${commands[@]/#/k8s.io/kubernetes/cmd/}"
  # The pod sandbox image's one binary, from the same tree.
  gcc -Os -static -o "$work/bin/pause" build/pause/linux/pause.c
  strip "$work/bin/pause"
}

mkdir -p "$cache"
# One build at a time (two test sessions may start together); the second finds the cache.
exec 9>"$cache/.lock"
flock 9
install_packages
if [ -e "$out/.complete" ]; then
  echo "$out/bin"
  exit 0
fi
# The source tree and Go's build cache, deleted once the binaries exist.
ensure_space 5 "$cache"
work="$cache/build"
tree="$work/kubernetes"
started=$SECONDS
log "building Kubernetes $version from Debian's source package into $out (about 10 minutes)"
fetch_source
build_binaries
rm -rf "$out" && mkdir -p "$out"
mv "$work/bin" "$out/bin"
# The Go build cache and the tree (2 GB) are not needed once the binaries exist.
rm -rf "$work"
touch "$out/.complete"
log "built in $((SECONDS - started)) s"
echo "$out/bin"
