#!/usr/bin/env bash
# cairn's tests against the S3 server that scripts/minio.sh or scripts/ceph.sh started:
#
#   scripts/minio.sh run bash scripts/s3_suite.sh DATASET_DIR
#   scripts/ceph.sh run bash scripts/s3_suite.sh DATASET_DIR
#
# 1. the store conformance suite and the CLI end to end (cargo test; profile $CAIRN_PROFILE, or release);
# 2. scripts/many_hosts.py: four hosts commit dataset images while another serves a version
#    over NBD and a collector removes a version and runs gc; verify and bit-exact restores;
# 3. scripts/stress_gc.py on the bucket: committers against prune+gc, then kill -9 of gc.
# Needs the variables those scripts export (CAIRN_TEST_S3_URL, AWS_*); CAIRN_BIN may name
# the release binary.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DATASET=${1:?usage: s3_suite.sh DATASET_DIR}
[ -n "${CAIRN_TEST_S3_URL:-}" ] || die "CAIRN_TEST_S3_URL is unset: run under scripts/minio.sh run or scripts/ceph.sh run"
SERVER=${CAIRN_TEST_S3_SERVER:-s3}
CAIRN_BIN=${CAIRN_BIN:-$(cairn_bin)}
export CAIRN_BIN
base=${CAIRN_TEST_S3_URL%%\?*}
query=${CAIRN_TEST_S3_URL#*\?}

log "$SERVER: conformance suite and CLI end to end"
# --workspace, so that features unify as in the suite's own build and nothing is rebuilt.
(cd "$ROOT" && cargo test --profile "${CAIRN_PROFILE:-release}" --workspace --test minio --test cli_s3)

log "$SERVER: many hosts on one bucket"
python3 "$ROOT/scripts/many_hosts.py" --dataset "$DATASET"

log "$SERVER: GC stress on the bucket"
# The leak check runs once, on a local repository (test.sh): it measures GC, not the store.
python3 "$ROOT/scripts/stress_gc.py" --seconds 30 --leak-seconds 0 --repo "$base/stress?$query"
