#!/usr/bin/env bash
# A throw-away MinIO server on 127.0.0.1 for cairn's S3 tests.
#
#   scripts/minio.sh install          build MinIO if missing (go install, ~4 min); print its path
#   scripts/minio.sh run CMD [ARG...] start MinIO (temp data dir, random port and credentials),
#                                     create a bucket, run CMD with the S3 variables exported,
#                                     stop MinIO and remove its data; exit with CMD's status
#
# CMD sees: CAIRN_TEST_S3_URL=s3://BUCKET/PREFIX?endpoint=...&path_style=true, AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP and CAIRN_REQUIRE_S3=1.
# Example:
#   scripts/minio.sh run cargo test -p cairn-store-s3 --test minio
#
# The binary is looked up on PATH, then in $ROOT/.data/bin, the user's cache
# (${XDG_CACHE_HOME:-~/.cache}/cairn/bin) and ~/go/bin; a fresh build goes to the cache, so a new
# clone of cairn on the same host does not build it again. Needs go (PATH or
# /usr/local/go/bin) and curl (for --aws-sigv4).
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

minio_bin() {
  local c cache="${XDG_CACHE_HOME:-$HOME/.cache}/cairn/bin"
  for c in "$(command -v minio 2>/dev/null || true)" "$ROOT/.data/bin/minio" "$cache/minio" \
    "$HOME/go/bin/minio"; do
    if [ -n "$c" ] && [ -x "$c" ]; then
      printf '%s\n' "$c"
      return 0
    fi
  done
  local go
  go=$(command -v go 2>/dev/null || true)
  [ -n "$go" ] || go=/usr/local/go/bin/go
  [ -x "$go" ] || die "MinIO is not installed and go is missing (install Go, or put minio on PATH)"
  mkdir -p "$cache"
  log "building MinIO with go install into $cache (takes ~4 minutes, once per host)"
  GOBIN="$cache" "$go" install github.com/minio/minio@latest >&2 \
    || die "go install github.com/minio/minio@latest failed"
  printf '%s\n' "$cache/minio"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

random_token() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | head -c "$1"; }

MINIO_PID=
MINIO_DIR=
stop_minio() {
  if [ -n "$MINIO_PID" ]; then
    kill "$MINIO_PID" 2>/dev/null || true
    wait "$MINIO_PID" 2>/dev/null || true
    MINIO_PID=
  fi
  if [ -n "$MINIO_DIR" ]; then
    rm -rf "$MINIO_DIR"
    MINIO_DIR=
  fi
}

run() {
  [ "$#" -gt 0 ] || die "usage: $0 run CMD [ARG...]"
  command -v curl >/dev/null || die "curl is needed to create the bucket"
  local bin port console user pass bucket endpoint
  bin=$(minio_bin)
  port=$(free_port)
  console=$(free_port)
  user="cairn$(random_token 12)"
  pass=$(random_token 40)
  bucket="cairn-test-$(random_token 8)"
  endpoint="http://127.0.0.1:$port"
  MINIO_DIR=$(mktemp -d "${TMPDIR:-/tmp}/cairn-minio.XXXXXX")
  trap stop_minio EXIT
  trap 'exit 130' INT TERM
  # Credentials go through the environment only, never the command line (visible in ps).
  MINIO_ROOT_USER="$user" MINIO_ROOT_PASSWORD="$pass" MINIO_UPDATE=off \
    MINIO_CALLHOME_ENABLE=off MINIO_BROWSER=off MINIO_PROMETHEUS_AUTH_TYPE=public \
    "$bin" server --quiet --address "127.0.0.1:$port" --console-address "127.0.0.1:$console" \
    "$MINIO_DIR/data" >"$MINIO_DIR/minio.log" 2>&1 &
  MINIO_PID=$!
  local i
  for i in $(seq 1 100); do
    if curl -fsS -o /dev/null "$endpoint/minio/health/ready" 2>/dev/null; then break; fi
    kill -0 "$MINIO_PID" 2>/dev/null || { cat "$MINIO_DIR/minio.log" >&2; die "MinIO exited at start"; }
    [ "$i" -lt 100 ] || { cat "$MINIO_DIR/minio.log" >&2; die "MinIO not ready after 20 s"; }
    sleep 0.2
  done
  # The credentials go to curl in a config file on stdin, not on its command line. A server
  # that is ready may still answer 503 for a moment while it initialises: retry.
  for i in $(seq 1 50); do
    if printf 'user = "%s:%s"\n' "$user" "$pass" \
      | curl -fsS -K - --aws-sigv4 "aws:amz:us-east-1:s3" -X PUT "$endpoint/$bucket" >/dev/null 2>&1; then
      break
    fi
    [ "$i" -lt 50 ] || die "creating bucket $bucket on $endpoint failed (50 attempts in 10 s)"
    sleep 0.2
  done
  log "MinIO at $endpoint (pid $MINIO_PID), bucket $bucket"

  local status=0
  CAIRN_TEST_S3_URL="s3://$bucket/test?endpoint=$endpoint&path_style=true" \
    AWS_ACCESS_KEY_ID="$user" AWS_SECRET_ACCESS_KEY="$pass" AWS_ENDPOINT_URL="$endpoint" \
    AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true CAIRN_REQUIRE_S3=1 \
    CAIRN_TEST_S3_BUCKET="$bucket" CAIRN_TEST_S3_SERVER=minio "$@" || status=$?
  stop_minio
  return "$status"
}

case "${1:-}" in
  install) minio_bin ;;
  run) shift; run "$@" ;;
  -h | --help | "") sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "minio.sh: unknown command: $1 (try --help)" >&2; exit 2 ;;
esac
