#!/usr/bin/env bash
# Sheepdog's own direct-write experiment (issue 17), in a real guest:
# three `ovis node`s on loopback, objects on tmpfs, copies 3, a QEMU guest
# (internal/guest: Debian's cloud kernel, busybox) whose virtio disk is a
# VDI, running `dd of=/dev/vda bs=1M count=100 oflag=direct` RUNS times
# per mode, averaged as Sheepdog's developers did (13.3 MB/s emulated, 13.7
# native, +3 %). The guest's root is its initramfs, so the VDI is its only
# disk, /dev/vda (Sheepdog's /dev/vdb was the second disk after the
# system's).
#
#   writeback: drive cache=writeback, the guest's write cache on (its
#              default): plain writes;
#   emulated:  drive cache=writethrough through node 2, whose gateway runs
#              with --nbd-no-fua (a diagnostic): QEMU sends write + flush;
#   native:    drive cache=writethrough through node 1 (FUA advertised):
#              QEMU sends FUA writes.
#
# Each mode has its own VDI (a VDI is writable through one gateway at a
# time). The guest fills a 100 MiB file in its tmpfs from /dev/urandom
# once per boot and dd reads that: /dev/urandom under TCG is slower than
# the disk. The nodes' metrics are read around every run and printed with
# it, so that each mode shows what reached the nodes.
#
# Usage: bench/guest-dd.sh [RUNS (default 5)]
#   ROUNDS=1   boots per mode, interleaved across the modes
#   COUNT=100  1 MiB blocks per dd
#   OVIS_GUEST_TCG=1 skips the KVM probe (internal/guest falls back to TCG
#   when KVM is missing or hangs).
source "$(dirname "$0")/lib.sh"
RUNS=${1:-5}
ROUNDS=${ROUNDS:-1}
COUNT=${COUNT:-100}
for t in qemu-system-x86_64 busybox; do
	command -v "$t" >/dev/null || { echo "needs $t: scripts/test.sh installs qemu-system-x86, busybox-static and linux-image-cloud-amd64" >&2; exit 1; }
done
build_ovis
(cd "$(dirname "$0")/.." && go build -o "$BENCH_DIR/guestdd" ./bench/guestdd)
TMP=${CLUSTER_TMPFS:-/dev/shm/ovis-bench-gdd.$$}
mkdir -p "$TMP"
PIDS=()
cleanup() {
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$TMP"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

E1=$(port); E2=$(port); NBD1=$(port); NBD2=$(port)
for i in 1 2 3; do
	L[$i]=127.0.0.1:$(port)
	M[$i]=127.0.0.1:$(port)
done
for i in 1 2 3; do
	extra=(--etcd "http://127.0.0.1:$E1")
	case $i in
	1) extra=(--etcd-listen "http://127.0.0.1:$E1" --etcd-peer "http://127.0.0.1:$E2" --nbd "127.0.0.1:$NBD1") ;;
	2) extra+=(--nbd "127.0.0.1:$NBD2" --nbd-no-fua) ;;
	esac
	"$OVIS" node --dir "$TMP/n$i" --listen "${L[$i]}" --metrics "${M[$i]}" --log-level warn "${extra[@]}" >"$TMP/n$i.out" 2>"$TMP/n$i.log" &
	PIDS+=($!)
	for _ in $(seq 300); do grep -q "serving on" "$TMP/n$i.out" 2>/dev/null && break; sleep 0.1; done
	grep -q "serving on" "$TMP/n$i.out" || { echo "node $i did not start:" >&2; cat "$TMP/n$i.log" >&2; exit 1; }
done
sleep 1
"$OVIS" cluster format --copies 3 -a "${L[1]}" >/dev/null
for m in writeback emulated native; do
	"$OVIS" vdi create "dd-$m" 256M -a "${L[1]}" >/dev/null
done

echo "# $(date -Is) ovis $(git -C "$(dirname "$0")/.." rev-parse --short HEAD); 3 nodes, copies 3, tmpfs; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
"$BENCH_DIR/guestdd" -runs "$RUNS" -rounds "$ROUNDS" -count "$COUNT" \
	-writeback "nbd://127.0.0.1:$NBD1/dd-writeback" \
	-emulated "nbd://127.0.0.1:$NBD2/dd-emulated" \
	-native "nbd://127.0.0.1:$NBD1/dd-native" \
	-metrics "${M[1]},${M[2]},${M[3]}"
