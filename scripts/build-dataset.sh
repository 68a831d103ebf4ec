#!/usr/bin/env bash
# cairn's own builder of real, bootable Debian disk images and realistic version series of them.
#
#   scripts/build-dataset.sh OUTDIR [--small]
#
# Needs root (debootstrap, loop mounts, chroot), a free loop device and the Debian package mirror
# that apt on this machine already uses (read from apt's configuration; nothing is hard-coded).
# Installs its own host dependencies with apt-get.
#
# Idempotent: an image that already exists in OUTDIR is kept. Atomic: every image is built under
# OUTDIR/.work and moved into OUTDIR only when complete. Concurrent runs on the same OUTDIR are
# serialised by flock on OUTDIR/.lock (the second one waits, then finds the images made).
#
# Series "su" (a VM updated over time, like CloudVS's DS-SU), each made in place from the
# previous one on a loop mount, so blocks change the way they do in a running VM:
#   su-0.raw  debootstrap minbase + systemd, udev, kmod, iproute2, procps, e2fsprogs
#   su-1.raw  + openssh-server curl less vim-tiny python3-minimal
#   su-2.raw  + gcc make libc6-dev
#   su-3.raw  user work: a source tree written, compiled, logs appended, some files deleted
#   su-4.raw  purge vim-tiny and curl, apt-get clean, + git
#   su-5.raw  reinstall of coreutils, bash, systemd, libc-bin (same bytes, new block positions)
# Set "pa" (many VMs cloned from one base, like CloudVS's DS-PA), each from su-1:
#   pa-a.raw  + python3 python3-venv           + user files of seed a
#   pa-b.raw  + gcc make                        + user files of seed b
#   pa-c.raw  + nginx-light                     + user files of seed c
# A VM that stays up, with a guest agent (cairn's own; not in the shared builder):
#   vm-agent.raw  su-1 + qemu-guest-agent, without the boot marker's poweroff
# Rebuilt layout (a golden image rebuilt by a pipeline, same content, new layout):
#   su-1-rebuilt.raw  the su-1 tree written by mkfs.ext4 -d into a fresh file system
# Boot files for QEMU (the host's Debian kernel and initrd):
#   boot/vmlinuz  boot/initrd.img
# Every image boots with:  -kernel boot/vmlinuz -initrd boot/initrd.img
#   -append 'root=/dev/vda ro console=ttyS0'                       (systemd; prints SYSTEMD-MARKER-REACHED, powers off)
#   -append 'root=/dev/vda ro console=ttyS0 init=/sbin/marker-init' (fast; prints MARKER-INIT-REACHED, powers off)
# Full: 2 GiB images, all of the above.
# --small: 1 GiB images, only su-0, su-1, su-2, vm-agent and boot files (for test suites).
#
# The steps, seeds, file system UUID and hash seed are the same as in the shared
# build-debian-series.sh, so images built by either script have the same content
# (vm-agent.raw is this builder's alone).
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { echo "usage: $0 OUTDIR [--small]" >&2; exit 2; }

OUT=""
SMALL=""
for a in "$@"; do
  case "$a" in
    --small) SMALL=--small ;;
    -h | --help) usage ;;
    -*) echo "unknown option: $a" >&2; usage ;;
    *) [ -z "$OUT" ] || usage; OUT=$a ;;
  esac
done
[ -n "$OUT" ] || usage

SIZE=2G
SIZE_BYTES=$((2 * 1024 * 1024 * 1024))
if [ "$SMALL" = "--small" ]; then
  SIZE=1G
  SIZE_BYTES=$((1024 * 1024 * 1024))
fi
UUID=2f1c3d6e-5b4a-4c2e-9d1f-7a8b9c0d1e2f
HASHSEED=6b8f1e2a-3c4d-4e5f-8a9b-0c1d2e3f4a5b

IMAGES="su-0.raw su-1.raw su-2.raw vm-agent.raw"
[ "$SMALL" = "--small" ] || IMAGES="$IMAGES su-3.raw su-4.raw su-5.raw pa-a.raw pa-b.raw pa-c.raw su-1-rebuilt.raw"

all_present() {
  local f
  for f in $IMAGES boot/vmlinuz boot/initrd.img SIZES.txt; do
    [ -e "$OUT/$f" ] || return 1
  done
}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# --- lock: one builder per OUTDIR ------------------------------------------------------------
exec 9>"$OUT/.lock"
if ! flock -n 9; then
  log "another build holds $OUT/.lock; waiting for it"
  flock 9
fi

# A variant mix-up (full images in a --small dir or the reverse) would silently give wrong sizes.
if [ -e "$OUT/su-0.raw" ]; then
  have=$(stat -c %s "$OUT/su-0.raw")
  [ "$have" -eq "$SIZE_BYTES" ] \
    || die "$OUT/su-0.raw is $have bytes, expected $SIZE_BYTES for ${SMALL:-full}; use another OUTDIR"
fi

if all_present; then
  log "all images present in $OUT; nothing to do"
  exit 0
fi
need_root "debootstrap, loop mounts and chroot"

# --- host dependencies -------------------------------------------------------------------------
ensure_apt_packages debootstrap e2fsprogs util-linux coreutils tar
if ! ls /boot/vmlinuz-* >/dev/null 2>&1; then
  log "no kernel in /boot: installing a Debian kernel and initrd tools"
  ensure_apt_packages linux-image-amd64 initramfs-tools
fi
ls /boot/vmlinuz-* >/dev/null 2>&1 || die "no /boot/vmlinuz-* after installing linux-image-amd64"

mirror() { # the first Debian mirror that apt is configured with
  local m
  m=$(grep -h -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)
  if [ -z "$m" ]; then
    # "deb [opts] URI suite ..." in sources.list or *.list
    m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | sed -E -n 's/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' \
      | grep -v security | head -1 || true)
  fi
  [ -n "$m" ] || die "no Debian mirror found in apt's configuration"
  echo "$m"
}
MIRROR=$(mirror)
log "mirror: $MIRROR; images: ${SMALL:-full} ($SIZE)"

WORK="$OUT/.work"
MNT="$WORK/mnt"
mkdir -p "$WORK" "$OUT/boot"

# --- cleanup: unmount everything under $WORK, drop partial images on failure --------------------
mounts_under() { # mount points below $1, deepest first (mountinfo escapes spaces as \040)
  local mp
  while read -r _ _ _ _ mp _; do
    mp=$(printf '%b' "$mp")
    case "$mp" in "$1"/*) printf '%s\n' "$mp" ;; esac
  done </proc/self/mountinfo | awk '{ print length($0) "\t" $0 }' | sort -rn | cut -f2-
}
cleanup() {
  local rc=$? mp
  sync
  while IFS= read -r mp; do
    [ -n "$mp" ] || continue
    umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || log "warning: could not unmount $mp"
  done < <(mounts_under "$WORK")
  if [ "$rc" -ne 0 ]; then
    rm -f "$WORK"/*.tmp
    log "FAILED (exit $rc); partial files removed, finished images kept in $OUT"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

put_markers() { # $1 = rootfs
  cat >"$1/sbin/marker-init" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
echo "MARKER-INIT-REACHED uptime=$(cut -d' ' -f1 /proc/uptime)"
sync
echo o > /proc/sysrq-trigger
sleep 10
EOF
  chmod 755 "$1/sbin/marker-init"
  mkdir -p "$1/etc/systemd/system/multi-user.target.wants"
  cat >"$1/etc/systemd/system/marker.service" <<'EOF'
[Unit]
Description=Boot marker
After=multi-user.target
[Service]
Type=oneshot
StandardOutput=tty
TTYPath=/dev/ttyS0
ExecStart=/bin/sh -c 'echo "SYSTEMD-MARKER-REACHED uptime=$(cut -d" " -f1 /proc/uptime)"'
ExecStartPost=/bin/systemctl poweroff --no-block
[Install]
WantedBy=multi-user.target
EOF
  ln -sf /etc/systemd/system/marker.service "$1/etc/systemd/system/multi-user.target.wants/marker.service"
  echo "vm" >"$1/etc/hostname"
  printf '/dev/vda / ext4 defaults 0 1\n' >"$1/etc/fstab"
}

apt_on() { # point the image's apt at the host's mirror while we work in it
  printf 'deb %s bookworm main\n' "$MIRROR" >"$1/etc/apt/sources.list"
  rm -f "$1"/etc/apt/sources.list.d/*.sources
}
apt_off() { # leave no mirror address inside the image
  printf 'deb http://mirror.invalid/debian bookworm main\n' >"$1/etc/apt/sources.list"
  rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin
}

mount_img() {
  mkdir -p "$MNT"
  if mountpoint -q "$MNT"; then die "$MNT is already mounted (stale run?)"; fi
  mount -o loop "$1" "$MNT" || die "mount -o loop $1 failed (no free loop device? see losetup -a)"
  mount -t proc proc "$MNT/proc"
  mount --bind /dev "$MNT/dev"
}
umount_img() {
  sync
  umount "$MNT/dev" || true
  umount "$MNT/proc" || true
  umount "$MNT"
}
in_img() { chroot "$MNT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }

# Builds a fresh ext4 image of $SIZE from a directory tree into $2 (a temp name).
mkfs_from_tree() { # $1 = tree, $2 = image file
  rm -f "$2" # never reuse a stale temp file: its old blocks would leak into the image
  truncate -s "$SIZE" "$2"
  mkfs.ext4 -q -L vmroot -U "$UUID" -E hash_seed="$HASHSEED" -d "$1" "$2"
}

evolve() { # $1 = from, $2 = to, $3 = function that changes the mounted image
  if [ -e "$OUT/$2" ]; then log "$2 exists"; return 0; fi
  log "making $2 from $1"
  rm -f "$WORK/$2.tmp"
  cp --sparse=always "$OUT/$1" "$WORK/$2.tmp"
  mount_img "$WORK/$2.tmp"
  apt_on "$MNT"
  "$3"
  apt_off "$MNT"
  umount_img
  e2fsck -fn "$WORK/$2.tmp" >/dev/null 2>&1 || die "$2: file system check failed"
  mv "$WORK/$2.tmp" "$OUT/$2"
}

user_files() { # $1 = seed: a deterministic tree of text and binary files with a log
  in_img sh -c "mkdir -p /home/user/project && cd /home/user/project && \
    i=0; while [ \$i -lt 300 ]; do \
      printf '/* file %s of seed $1 */\n#include <stdio.h>\nint f_%s(void){return %s;}\n' \$i \$i \$((i*7)) > src_\$i.c; \
      i=\$((i+1)); done; \
    head -c 8388608 /dev/zero | tr '\\0' 'x' > data_$1.txt; \
    seq 1 200000 | sed 's/^/log line seed $1 /' >> /var/log/app_$1.log"
  # pseudo-random binary data derived from the seed (repeatable; python3-minimal is in su-1 and later)
  in_img python3 -c "import random,sys; random.seed('$1'); sys.stdout.buffer.write(random.randbytes(4194304))" >"$MNT/home/user/blob_$1.bin"
}

# --- su-0: a fresh file system from debootstrap --------------------------------------------------
if [ ! -e "$OUT/su-0.raw" ]; then
  ROOTFS="$WORK/rootfs-0"
  if [ ! -e "$WORK/rootfs-0.tar" ]; then
    log "debootstrap (about 1-2 minutes)"
    rm -rf "$ROOTFS"
    mkdir -p "$ROOTFS"
    if ! debootstrap --variant=minbase \
      --include=systemd-sysv,udev,kmod,iproute2,procps,e2fsprogs,ca-certificates \
      bookworm "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
      tail -n 30 "$WORK/debootstrap.log" >&2 || true
      die "debootstrap failed (full log: $WORK/debootstrap.log)"
    fi
    put_markers "$ROOTFS"
    apt_off "$ROOTFS"
    chroot "$ROOTFS" apt-get clean
    # cache the tree (reruns after a failure skip debootstrap); written atomically
    tar -C "$ROOTFS" -cf "$WORK/rootfs-0.tar.part" .
    mv "$WORK/rootfs-0.tar.part" "$WORK/rootfs-0.tar"
  else
    log "using cached $WORK/rootfs-0.tar"
    rm -rf "$ROOTFS"
    mkdir -p "$ROOTFS"
    tar -C "$ROOTFS" -xf "$WORK/rootfs-0.tar"
  fi
  log "mkfs su-0.raw ($SIZE)"
  mkfs_from_tree "$ROOTFS" "$WORK/su-0.tmp"
  mv "$WORK/su-0.tmp" "$OUT/su-0.raw"
  rm -rf "$ROOTFS"
fi

step1() { in_img apt-get update -qq; in_img apt-get install -y -qq openssh-server curl less vim-tiny python3-minimal >/dev/null; in_img apt-get clean; }
step2() { in_img apt-get update -qq; in_img apt-get install -y -qq gcc make libc6-dev >/dev/null; in_img apt-get clean; }
step3() {
  user_files su
  in_img sh -c "cd /home/user/project && cat src_*.c > all.c && printf 'int main(void){return 0;}\n' >> all.c && gcc -O2 -o app all.c && rm -f src_1*.c"
}
step4() { in_img apt-get update -qq; in_img apt-get purge -y -qq vim-tiny curl >/dev/null; in_img apt-get install -y -qq git >/dev/null; in_img apt-get clean; }
step5() { in_img apt-get update -qq; in_img apt-get install -y -qq --reinstall coreutils bash systemd libc-bin >/dev/null; in_img apt-get clean; }
step_agent() {
  in_img apt-get update -qq
  in_img apt-get install -y -qq qemu-guest-agent >/dev/null
  in_img apt-get clean
  # Up until told otherwise: no poweroff after the boot marker. The agent starts when its
  # virtio port appears (Debian's udev rule).
  rm -f "$MNT/etc/systemd/system/multi-user.target.wants/marker.service"
  # The image boots the host's kernel (boot/vmlinuz), whose virtio console driver (the agent's
  # port) is a module: give the image that module and what it depends on, for this kernel.
  local k kver m
  k=$(printf '%s\n' /boot/vmlinuz-* | sort -V | tail -1)
  kver=${k#/boot/vmlinuz-}
  for m in kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko \
    kernel/drivers/char/virtio_console.ko modules.order modules.builtin modules.builtin.modinfo; do
    if [ -e "/lib/modules/$kver/$m" ]; then
      mkdir -p "$(dirname "$MNT/lib/modules/$kver/$m")"
      cp "/lib/modules/$kver/$m" "$MNT/lib/modules/$kver/$m"
    fi
  done
  depmod -b "$MNT" "$kver" || die "depmod for $kver in vm-agent.raw failed"
}
pa_a() { in_img apt-get update -qq; in_img apt-get install -y -qq python3 python3-venv >/dev/null; in_img apt-get clean; user_files a; }
pa_b() { in_img apt-get update -qq; in_img apt-get install -y -qq gcc make >/dev/null; in_img apt-get clean; user_files b; }
pa_c() { in_img apt-get update -qq; in_img apt-get install -y -qq nginx-light >/dev/null; in_img apt-get clean; user_files c; }

evolve su-0.raw su-1.raw step1
evolve su-1.raw su-2.raw step2
evolve su-1.raw vm-agent.raw step_agent
if [ "$SMALL" != "--small" ]; then
  evolve su-2.raw su-3.raw step3
  evolve su-3.raw su-4.raw step4
  evolve su-4.raw su-5.raw step5
  evolve su-1.raw pa-a.raw pa_a
  evolve su-1.raw pa-b.raw pa_b
  evolve su-1.raw pa-c.raw pa_c
  if [ ! -e "$OUT/su-1-rebuilt.raw" ]; then
    log "rebuilding su-1 with a fresh layout"
    mkdir -p "$MNT"
    mount -o loop,ro "$OUT/su-1.raw" "$MNT" || die "mount -o loop su-1.raw failed"
    rm -rf "$WORK/rootfs-1"
    mkdir -p "$WORK/rootfs-1"
    cp -a "$MNT/." "$WORK/rootfs-1/"
    umount "$MNT"
    rm -rf "$WORK/rootfs-1/lost+found"
    mkfs_from_tree "$WORK/rootfs-1" "$WORK/rebuilt.tmp"
    mv "$WORK/rebuilt.tmp" "$OUT/su-1-rebuilt.raw"
    rm -rf "$WORK/rootfs-1"
  fi
fi

# --- boot files ----------------------------------------------------------------------------------
K=$(printf '%s\n' /boot/vmlinuz-* | sort -V | tail -1)
I=/boot/initrd.img-${K#/boot/vmlinuz-}
[ -e "$I" ] || die "kernel $K has no initrd $I (apt-get install initramfs-tools, then update-initramfs -c -k all)"
cp -f "$K" "$OUT/boot/vmlinuz.tmp"
mv -f "$OUT/boot/vmlinuz.tmp" "$OUT/boot/vmlinuz"
cp -f "$I" "$OUT/boot/initrd.img.tmp"
mv -f "$OUT/boot/initrd.img.tmp" "$OUT/boot/initrd.img"

# --- SIZES.txt (same format as the shared script) --------------------------------------------------
(
  cd "$OUT"
  for f in *.raw; do
    printf '%s %s %s\n' "$f" "$(stat -c %s "$f")" "$(du -k "$f" | cut -f1)KiB-allocated"
  done
) >"$OUT/SIZES.txt.tmp"
mv -f "$OUT/SIZES.txt.tmp" "$OUT/SIZES.txt"
rm -rf "$MNT"
log "done: $(find "$OUT" -maxdepth 1 -name '*.raw' | wc -l) images in $OUT"
