#!/usr/bin/env bash
# A throw-away single-node Ceph cluster with a RADOS Gateway (S3) on 127.0.0.1 for cairn's tests.
#
#   scripts/ceph.sh install          apt-get install ceph-mon ceph-osd radosgw ceph-common if missing
#   scripts/ceph.sh run CMD [ARG...] start a monitor, one BlueStore OSD (sparse file) and radosgw
#                                     in a temp dir (random ports and keys), create an S3 user and
#                                     a bucket, run CMD with the S3 variables exported, stop every
#                                     daemon and remove the temp dir; exit with CMD's status
#
# CMD sees: CAIRN_TEST_S3_URL=s3://BUCKET/PREFIX?endpoint=...&path_style=true, AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP, CAIRN_REQUIRE_S3=1 and
# CAIRN_TEST_S3_SERVER=ceph-rgw. Example:
#   scripts/ceph.sh run cargo test -p cairn-store-s3 --test minio
#
# Debian/Ubuntu; `install` needs root, `run` does not. Everything (config, keyrings, mon and OSD
# data, logs, sockets) lives in the temp dir ($TMPDIR or /tmp): /etc/ceph and /var/lib/ceph are
# never touched. S3 answers ~10 s after start; stopping takes ~1 s. Needs curl (for
# --aws-sigv4) and python3.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CEPH_PACKAGES=(ceph-mon ceph-osd radosgw ceph-common)
# How long each daemon may take to come up.
CEPH_START_TIMEOUT=90
RGW_NAME=client.rgw.cairn

install_ceph() {
  ensure_apt_packages "${CEPH_PACKAGES[@]}"
  local b
  for b in ceph ceph-mon ceph-osd radosgw radosgw-admin ceph-authtool monmaptool; do
    command -v "$b" >/dev/null || die "$b missing after installing ${CEPH_PACKAGES[*]}"
  done
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

random_token() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | head -c "$1"; }

CEPH_DIR=
CEPH_PIDS=()  # start order: mon, osd, rgw
CEPH_NAMES=() # the daemons' names, same order

stop_ceph() {
  local i pid n
  # One at a time in reverse start order (radosgw, OSD, monitor): each stops in ~0.1 s while
  # the daemons below it still run, but may wait seconds for them if they are stopped at once.
  for ((i = ${#CEPH_PIDS[@]} - 1; i >= 0; i--)); do
    pid=${CEPH_PIDS[i]}
    kill -TERM "$pid" 2>/dev/null || true
    for ((n = 0; n < 100; n++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "${CEPH_NAMES[i]} (pid $pid) still running 10 s after SIGTERM, killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  CEPH_PIDS=()
  CEPH_NAMES=()
  if [ -n "$CEPH_DIR" ]; then
    rm -rf "$CEPH_DIR"
    CEPH_DIR=
  fi
}

# The ceph CLI on the private cluster, never hanging for long.
cephc() { timeout 30 ceph -c "$CEPH_DIR/ceph.conf" --connect-timeout 10 "$@"; }

# Print the tail of a daemon's logs on stderr and die.
daemon_failed() {
  local name=$1 why=$2 f
  # The daemon's own log if it has one, else what it printed.
  for f in "$CEPH_DIR/log/$name.log" "$CEPH_DIR/log/$name.out"; do
    if [ -s "$f" ]; then
      printf -- '--- last lines of %s ---\n' "$f" >&2
      tail -n 30 "$f" >&2
      break
    fi
  done
  die "$name $why"
}

# wait_until NAME PID CHECK...: poll CHECK until it succeeds; die if PID exits or on timeout.
wait_until() {
  local name=$1 pid=$2 start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || daemon_failed "$name" "exited during start"
    [ $((SECONDS - start)) -lt "$CEPH_START_TIMEOUT" ] \
      || daemon_failed "$name" "not up after $CEPH_START_TIMEOUT s"
    sleep 0.5
  done
}

# Start a daemon in the foreground of a background job; its stdout/stderr go to log/NAME.out.
start_daemon() {
  local name=$1
  shift
  "$@" -c "$CEPH_DIR/ceph.conf" -f >"$CEPH_DIR/log/$name.out" 2>&1 &
  CEPH_PIDS+=("$!")
  CEPH_NAMES+=("$name")
}

S3_USER=
S3_PASS=
# s3_ok WHAT METHOD URL [CURL-ARG...]: a SigV4 request that must answer 2xx, else die with the
# server's error. The credentials go to curl in a config file on stdin, not on its command line.
# RGW, unlike MinIO, refuses SigV4 requests without x-amz-content-sha256 (SignatureDoesNotMatch).
s3_ok() {
  local what=$1 method=$2 url=$3 code
  shift 3
  code=$(printf 'user = "%s:%s"\n' "$S3_USER" "$S3_PASS" \
    | curl -sS -K - --aws-sigv4 "aws:amz:us-east-1:s3" -X "$method" \
      -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -o "$CEPH_DIR/log/s3.out" -w '%{http_code}' \
      "$@" "$url") || code=000
  case "$code" in
    2??) ;;
    *)
      cat "$CEPH_DIR/log/s3.out" >&2 2>/dev/null || true
      echo >&2
      die "$what on ${url%%\?*} failed (HTTP $code)"
      ;;
  esac
}

osd_up() { [ "$(cephc osd stat -f json | python3 -c 'import json,sys; print(json.load(sys.stdin)["num_up_osds"])')" -ge 1 ]; }

write_conf() {
  local d=$1 fsid=$2 mon_port=$3 rgw_port=$4
  cat >"$d/ceph.conf" <<EOF
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:$mon_port]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr1 = false
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
auth_allow_insecure_global_id_reclaim = false
run_dir = $d/run
admin_socket = $d/run/\$name.asok
pid_file = $d/run/\$name.pid
log_file = $d/log/\$name.log
keyring = $d/\$name.keyring
mon_data = $d/mon
osd_data = $d/osd
rgw_data = $d/rgw
crash_dir = $d/crash
mon_cluster_log_file = $d/log/cluster.log
mon_data_avail_warn = 2
mon_data_avail_crit = 1
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_max_pg_per_osd = 1000
# Commit monitor map changes every 0.1 s, not every 1 s: the OSD boot and the ~7 pools radosgw
# creates each wait for one.
paxos_propose_interval = 0.1

[osd]
osd_objectstore = bluestore
bluestore_block_path = $d/osd-block
bluestore_block_create = true
bluestore_block_size = 10737418240
bluestore_block_db_create = false
bluestore_block_wal_create = false
osd_memory_target = 536870912
bluestore_cache_autotune = false
bluestore_cache_size = 134217728
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 2

[$RGW_NAME]
rgw_frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw_thread_pool_size = 64
# No background work a short-lived test cluster needs; these threads also slow down shutdown.
rgw_enable_gc_threads = false
rgw_enable_lc_threads = false
rgw_enable_quota_threads = false
rgw_run_sync_thread = false
rgw_dynamic_resharding = false
EOF
}

run() {
  [ "$#" -gt 0 ] || die "usage: $0 run CMD [ARG...]"
  local b
  for b in ceph ceph-mon ceph-osd radosgw radosgw-admin ceph-authtool monmaptool; do
    command -v "$b" >/dev/null || die "$b not found: run '$0 install' first"
  done
  command -v curl >/dev/null || die "curl is needed to create the bucket"
  command -v python3 >/dev/null || die "python3 is needed"
  local t0=$SECONDS d fsid mon_port rgw_port endpoint bucket osd_uuid osd_id keys user pass
  fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  mon_port=$(free_port)
  rgw_port=$(free_port)
  [ "$mon_port" != "$rgw_port" ] || rgw_port=$(free_port)
  endpoint="http://127.0.0.1:$rgw_port"
  bucket="cairn-test-$(random_token 8)"
  CEPH_DIR=$(mktemp -d "${TMPDIR:-/tmp}/cairn-ceph.XXXXXX")
  trap stop_ceph EXIT
  trap 'exit 130' INT TERM
  d=$CEPH_DIR
  mkdir -p "$d/run" "$d/log" "$d/mon" "$d/osd" "$d/rgw" "$d/crash"
  write_conf "$d" "$fsid" "$mon_port" "$rgw_port"

  # Monitor, with the mon. and client.admin keys.
  ceph-authtool --create-keyring "$d/mon.a.keyring" --gen-key -n mon. --cap mon 'allow *' \
    >/dev/null
  ceph-authtool --create-keyring "$d/client.admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mds 'allow *' --cap mgr 'allow *' >/dev/null
  ceph-authtool "$d/mon.a.keyring" --import-keyring "$d/client.admin.keyring" >/dev/null
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$d/monmap" \
    >"$d/log/monmaptool.out" 2>&1 || daemon_failed monmaptool "failed"
  ceph-mon -c "$d/ceph.conf" --mkfs -i a --monmap "$d/monmap" --keyring "$d/mon.a.keyring" \
    >"$d/log/mon.a.out" 2>&1 || daemon_failed mon.a "--mkfs failed"
  start_daemon mon.a ceph-mon -i a
  wait_until mon.a "${CEPH_PIDS[0]}" cephc mon stat
  log "monitor up on 127.0.0.1:$mon_port ($((SECONDS - t0)) s)"

  # One BlueStore OSD on a sparse file.
  osd_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  osd_id=$(cephc osd new "$osd_uuid" 2>"$d/log/osd-new.out") || daemon_failed osd-new "failed"
  [ "$osd_id" = 0 ] || die "expected osd.0, got osd.$osd_id"
  cephc auth get-or-create osd.0 mon 'allow profile osd' mgr 'allow profile osd' osd 'allow *' \
    -o "$d/osd.0.keyring" >/dev/null 2>&1 || die "ceph auth get-or-create osd.0 failed"
  ceph-osd -c "$d/ceph.conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$d/log/osd.0.out" 2>&1 \
    || daemon_failed osd.0 "--mkfs failed"
  start_daemon osd.0 ceph-osd -i 0
  wait_until osd.0 "${CEPH_PIDS[1]}" osd_up
  log "osd.0 up ($((SECONDS - t0)) s)"

  # RADOS Gateway.
  cephc auth get-or-create "$RGW_NAME" mon 'allow rw' osd 'allow rwx' \
    -o "$d/$RGW_NAME.keyring" >/dev/null 2>&1 || die "ceph auth get-or-create $RGW_NAME failed"
  start_daemon "$RGW_NAME" radosgw -n "$RGW_NAME"
  wait_until "$RGW_NAME" "${CEPH_PIDS[2]}" curl -fsS -o /dev/null "$endpoint/"

  # An S3 user with random keys (made by radosgw-admin, kept out of argv and output).
  keys=$(timeout 60 radosgw-admin -c "$d/ceph.conf" user create --uid=cairn \
    --display-name=cairn 2>"$d/log/radosgw-admin.out" \
    | python3 -c 'import json,sys; k=json.load(sys.stdin)["keys"][0]; print(k["access_key"], k["secret_key"])') \
    || daemon_failed radosgw-admin "user create failed"
  user=${keys%% *} pass=${keys#* }
  if [ -z "$user" ] || [ -z "$pass" ]; then die "radosgw-admin user create returned no keys"; fi
  S3_USER=$user S3_PASS=$pass
  s3_ok "creating bucket $bucket" PUT "$endpoint/$bucket"
  # The first object PUT creates the data pool (~2 s): do it now, not in CMD's first write.
  s3_ok "writing a warm-up object" PUT "$endpoint/$bucket/cairn-warmup" --data-binary warmup
  s3_ok "deleting the warm-up object" DELETE "$endpoint/$bucket/cairn-warmup"
  log "Ceph RGW at $endpoint (ready $((SECONDS - t0)) s after start), bucket $bucket"

  local status=0
  CAIRN_TEST_S3_URL="s3://$bucket/test?endpoint=$endpoint&path_style=true" \
    AWS_ACCESS_KEY_ID="$user" AWS_SECRET_ACCESS_KEY="$pass" AWS_ENDPOINT_URL="$endpoint" \
    AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true CAIRN_REQUIRE_S3=1 \
    CAIRN_TEST_S3_BUCKET="$bucket" CAIRN_TEST_S3_SERVER=ceph-rgw "$@" || status=$?
  stop_ceph
  return "$status"
}

case "${1:-}" in
  install) install_ceph ;;
  run) shift; run "$@" ;;
  -h | --help | "") sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "ceph.sh: unknown command: $1 (try --help)" >&2; exit 2 ;;
esac
