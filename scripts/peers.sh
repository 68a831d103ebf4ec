#!/usr/bin/env bash
# Installs the peer tools the benchmarks compare cairn against, and prints where they are.
#
#   scripts/peers.sh install     install what is missing; print "name<TAB>path" per tool
#
# From Debian: restic, borgbackup, casync, qemu-utils (qcow2 chains), time (/usr/bin/time -v).
# Built from the Go module proxy at pinned versions (the proxy refuses `go install …@latest`
# for these two): Kopia and desync. Each is fetched with `go get` into a scratch module, with
# GONOSUMDB for that module, then built with `go build -mod=mod`. Binaries go to
# $ROOT/.data/bin (kept between runs). Needs go on PATH or in /usr/local/go/bin.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

KOPIA_VERSION=${KOPIA_VERSION:-v0.21.1}
DESYNC_VERSION=${DESYNC_VERSION:-v0.9.6}
BIN_DIR="$ROOT/.data/bin"

# go_build NAME MODULE VERSION PACKAGE: builds PACKAGE of MODULE@VERSION to $BIN_DIR/NAME.
go_build() {
  local name=$1 module=$2 version=$3 package=$4 out="$BIN_DIR/$1"
  local stamp="$out.version"
  if [ -x "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$module@$version" ]; then
    return 0
  fi
  local go
  go=$(command -v go 2>/dev/null || true)
  [ -n "$go" ] || go=/usr/local/go/bin/go
  [ -x "$go" ] || die "$name is not installed and go is missing (install Go 1.22 or newer)"
  local scratch
  scratch=$(mktemp -d)
  log "building $name $version from the Go module proxy (a few minutes)"
  (
    cd "$scratch"
    "$go" mod init cairn-peer-build >/dev/null 2>&1
    GONOSUMDB=$module GOFLAGS=-mod=mod "$go" get "$module@$version" >&2
    GONOSUMDB=$module "$go" build -mod=mod -o "$out" "$package" >&2
  ) || { rm -rf "$scratch"; die "building $name $module@$version failed"; }
  rm -rf "$scratch"
  echo "$module@$version" >"$stamp"
}

install() {
  ensure_apt_packages restic borgbackup casync qemu-utils time
  mkdir -p "$BIN_DIR"
  go_build kopia github.com/kopia/kopia "$KOPIA_VERSION" github.com/kopia/kopia
  go_build desync github.com/folbricht/desync "$DESYNC_VERSION" github.com/folbricht/desync/cmd/desync
  printf 'restic\t%s\n' "$(command -v restic)"
  printf 'borg\t%s\n' "$(command -v borg)"
  printf 'casync\t%s\n' "$(command -v casync)"
  printf 'qemu-img\t%s\n' "$(command -v qemu-img)"
  printf 'kopia\t%s\n' "$BIN_DIR/kopia"
  printf 'desync\t%s\n' "$BIN_DIR/desync"
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: $0 install" >&2; exit 2 ;;
esac
