# shellcheck shell=bash
# Shared helpers for cairn's scripts. Source it, do not run it:
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Defines ROOT (the repository root) and:
#   log MSG...                 timestamped message on stderr
#   die MSG...                 log and exit 1
#   need_root [WHY]            exit unless running as root
#   ensure_apt_packages PKG... install the missing ones (apt-get update runs at most once)
#   cairn_bin                  build the CLI (once; release, or $CAIRN_PROFILE) and echo its path
#   dataset_dir small|full     echo $ROOT/.data/small or $ROOT/.data/full, building it if needed (small: copied from the host cache when built before)

# Guard against double sourcing.
if [ -n "${_CAIRN_LIB_SOURCED:-}" ]; then return 0; fi
_CAIRN_LIB_SOURCED=1

# Command substitutions ($(cairn_bin), $(dataset_dir ...)) keep `set -e` semantics.
shopt -s inherit_errexit 2>/dev/null || true

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export ROOT

log() { printf '[%s] %s: %s\n' "$(date +%H:%M:%S)" "$(basename "${0:-cairn}")" "$*" >&2; }

die() { log "error: $*"; exit 1; }

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    die "must run as root${1:+ ($1)}; try: sudo $0"
  fi
}

# Prints the names of the given packages that are not installed.
_missing_apt_packages() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    case "$st" in
      ii*) ;;
      *) printf '%s\n' "$p" ;;
    esac
  done
}

# apt-get with a wait for the dpkg/lists locks (other apt runs on the machine are common in CI).
_apt_get() {
  local tries=0
  while :; do
    if DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@"; then
      return 0
    fi
    tries=$((tries + 1))
    [ "$tries" -lt 5 ] || return 1
    log "apt-get $1 failed (attempt $tries), retrying in 10 s"
    sleep 10
  done
}

ensure_apt_packages() {
  command -v dpkg-query >/dev/null 2>&1 || die "dpkg-query not found: these scripts need Debian or Ubuntu"
  local missing
  missing=$(_missing_apt_packages "$@")
  [ -n "$missing" ] || return 0
  # shellcheck disable=SC2086  # word splitting of the package list is intended
  set -- $missing
  need_root "to install: $*"
  if [ -z "${CAIRN_APT_UPDATED:-}" ]; then
    log "apt-get update"
    _apt_get update -qq || die "apt-get update failed"
    export CAIRN_APT_UPDATED=1
  fi
  log "apt-get install $*"
  _apt_get install -y -qq --no-install-recommends "$@" >/dev/null \
    || die "apt-get install $* failed"
}

# python_with PKG...: a Python interpreter that can import PKG (pip names), from a venv under
# ~/.cache/cairn/pyvenv made and filled the first time (python3-venv from apt); prints its path.
python_with() {
  local venv="${XDG_CACHE_HOME:-$HOME/.cache}/cairn/pyvenv"
  if [ ! -x "$venv/bin/python" ]; then
    ensure_apt_packages python3-venv >&2
    python3 -m venv "$venv" >&2 || die "python3 -m venv $venv failed"
  fi
  local pkg
  for pkg in "$@"; do
    "$venv/bin/python" -c "import $pkg" 2>/dev/null && continue
    log "pip install $pkg (into $venv)"
    "$venv/bin/pip" install -q "$pkg" >&2 || die "pip install $pkg failed"
  done
  echo "$venv/bin/python"
}

# Where cargo puts build output (honours CARGO_TARGET_DIR).
_cargo_target_dir() {
  local t=${CARGO_TARGET_DIR:-target}
  case "$t" in
    /*) printf '%s\n' "$t" ;;
    *) printf '%s\n' "$ROOT/$t" ;;
  esac
}

# Builds the CLI once per process tree and echoes the binary's path: the release profile, or
# $CAIRN_PROFILE (the test suite uses `ci`). Set CAIRN_BIN to an existing executable to skip
# the build. Cargo's output goes to stderr.
cairn_bin() {
  if [ -n "${CAIRN_BIN:-}" ] && [ -x "$CAIRN_BIN" ]; then
    printf '%s\n' "$CAIRN_BIN"
    return 0
  fi
  command -v cargo >/dev/null 2>&1 || die "cargo not found (install Rust: https://rustup.rs)"
  local profile=${CAIRN_PROFILE:-release}
  log "cargo build --profile $profile -p cairn-cli"
  (cd "$ROOT" && cargo build --profile "$profile" -p cairn-cli >&2) \
    || die "cargo build --profile $profile -p cairn-cli failed"
  local bin
  bin="$(_cargo_target_dir)/$profile/cairn"
  [ -x "$bin" ] || die "build succeeded but $bin is missing"
  printf '%s\n' "$bin"
}

# The images a dataset variant must contain.
_dataset_files() {
  case "$1" in
    small) echo "su-0.raw su-1.raw su-2.raw vm-agent.raw boot/vmlinuz boot/initrd.img SIZES.txt" ;;
    full) echo "su-0.raw su-1.raw su-2.raw su-3.raw su-4.raw su-5.raw pa-a.raw pa-b.raw pa-c.raw su-1-rebuilt.raw vm-agent.raw boot/vmlinuz boot/initrd.img SIZES.txt" ;;
    *) return 1 ;;
  esac
}

# Where a built small dataset is kept for other checkouts on this host: the user's cache,
# keyed by the builder's own text (a changed builder builds again). Only the small dataset
# (the test suite's) is kept: the benchmarks' full dataset is rebuilt from Debian's archive
# as it is on the day.
_dataset_cache() {
  local key
  key=$(sha256sum "$ROOT/scripts/build-dataset.sh" | cut -c1-16)
  printf '%s\n' "${XDG_CACHE_HOME:-$HOME/.cache}/cairn/datasets/small-$key"
}

# Copies the files of dataset directory FROM to TO (sparse), each under a temporary name then
# renamed: a copy killed half way leaves no file that passes for complete.
_dataset_copy() { # FROM TO FILES...
  local from=$1 to=$2 f
  shift 2
  for f in "$@"; do
    mkdir -p "$(dirname "$to/$f")"
    cp --sparse=always "$from/$f" "$to/$f.copying" && mv -f "$to/$f.copying" "$to/$f" || return 1
  done
}

# Echoes the absolute path of the dataset; builds it (as root) if any file is missing — or,
# for the small one, copies it from the cache a build on this host left (seconds, not the
# build's minutes; CAIRN_DATASET_CACHE=0: always build).
dataset_dir() {
  local kind=${1:-} files f dir missing=0 cache=""
  files=$(_dataset_files "$kind") || die "dataset_dir: expected 'small' or 'full', got '$kind'"
  dir="$ROOT/.data/$kind"
  for f in $files; do
    [ -e "$dir/$f" ] || { missing=1; break; }
  done
  if [ "$kind" = small ] && [ "${CAIRN_DATASET_CACHE:-1}" != 0 ]; then
    cache=$(_dataset_cache)
  fi
  if [ "$missing" -eq 1 ] && [ -n "$cache" ] && [ -e "$cache/.complete" ]; then
    log "copying the $kind dataset from $cache (built on this host before)"
    # shellcheck disable=SC2086 # the file list is space-separated on purpose
    if _dataset_copy "$cache" "$dir" $files; then
      missing=0
    else
      log "copying from the cache failed; building the $kind dataset instead"
    fi
  fi
  if [ "$missing" -eq 1 ]; then
    need_root "building the $kind dataset needs debootstrap and loop mounts"
    log "building the $kind dataset in $dir (a few minutes the first time)"
    if [ "$kind" = small ]; then
      bash "$ROOT/scripts/build-dataset.sh" "$dir" --small >&2 || die "dataset build failed"
    else
      bash "$ROOT/scripts/build-dataset.sh" "$dir" >&2 || die "dataset build failed"
    fi
    if [ -n "$cache" ]; then
      # Kept for the next checkout: copied whole, then marked complete (best effort).
      # shellcheck disable=SC2086
      { rm -rf "$cache.tmp" && _dataset_copy "$dir" "$cache.tmp" $files &&
        touch "$cache.tmp/.complete" && rm -rf "$cache" && mv "$cache.tmp" "$cache" &&
        find "$(dirname "$cache")" -maxdepth 1 -name 'small-*' ! -name "$(basename "$cache")" \
          -exec rm -rf {} +; } ||
        log "could not keep the $kind dataset in $cache (it is built again next time)"
    fi
  fi
  printf '%s\n' "$dir"
}
