#!/usr/bin/env bash
# Three `ovis node`s on loopback, data on tmpfs, copies=3, one VDI; fio
# through NBD on the first node: 4 KiB random read and write at QD1 and
# QD16, 1 MiB sequential write and read at QD1. Prints the median of REPS
# runs per job, the server CPU time per request summed over the three
# nodes, and each node's RSS.
#
# With PEER=ceph it runs the same fio jobs against Ceph RBD (fio's rbd
# engine, the cluster ../shared/peers/ceph/setup.sh builds: 3 OSDs on
# tmpfs, size 3) in the same run, interleaved, and prints the ratios.
#
# Usage: bench/cluster.sh [VDI SIZE (default 1G)] [RUNTIME s (default 10)] [REPS (default 3)]
# ONLY=REGEX runs only the jobs whose name matches (ONLY=randread: the
# 4 KiB random read rows).
source "$(dirname "$0")/lib.sh"
SIZE=${1:-1G}
RUNTIME=${2:-10}
REPS=${3:-3}
PEER=${PEER:-}
need_tools
command -v nbdinfo >/dev/null || { echo "install libnbd-bin" >&2; exit 1; }
build_ovis

cluster_dir cluster
node_ports
start_nodes bench "$SIZE"
URI="nbd://127.0.0.1:$NBD/bench"
echo "# $(date -Is) ovis $(git -C "$(dirname "$0")/.." rev-parse --short HEAD), 3 nodes, copies 3, data on $TMP; load $(cut -d' ' -f1-3 /proc/loadavg)"

# Fill the VDI once so that reads hit data on every replica.
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=100% >/dev/null 2>&1
RBD="--ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench --direct=1"
if [ "$PEER" = ceph ]; then
	# The peer's client without librbd's cache, as the peer's own
	# reference figures were taken; the same range, filled the same way.
	CEPH_PEER_DIR=${CEPH_PEER:-${TMPDIR:-/tmp}/ceph-peer}
	sed 's/^rbd_cache = true/rbd_cache = false/' /etc/ceph/ceph.conf >"$TMP/ceph-nocache.conf"
	export CEPH_CONF=$TMP/ceph-nocache.conf
	ceph_pids=$(awk '$1 ~ /^(mon|mgr|osd)\./ {print $2}' "$CEPH_PEER_DIR/pids")
	fio --name=fill $RBD --rw=write --bs=1M --iodepth=16 --size="$SIZE" >/dev/null 2>&1
	echo "# peer: Ceph $(ceph --version | awk '{print $3}'), pool rbd size 3 on 3 OSDs on tmpfs (../shared/peers/ceph)"
fi
ceph_ticks() { local s=0; for p in $ceph_pids; do set -- $(cut -d' ' -f14,15 "/proc/$p/stat"); s=$((s + $1 + $2)); done; echo "$s"; }

node_ticks() { local s=0; for p in "${PIDS[@]}"; do set -- $(cut -d' ' -f14,15 "/proc/$p/stat"); s=$((s + $1 + $2)); done; echo "$s"; }
node_rss() { for p in "${PIDS[@]}"; do awk '/VmRSS/ {printf "%d ", $2/1024}' "/proc/$p/status"; done; }
HZ=$(getconf CLK_TCK)

# run_fio ENGINE-ARGS... -- JOB-ARGS... — prints "IOPS MB/s".
run_fio() {
	fio --name=b "$@" --time_based --runtime="$RUNTIME" --ramp_time=1 --output-format=json 2>/dev/null |
		python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"]; io=sum(x["read"]["iops"]+x["write"]["iops"] for x in j); bw=sum(x["read"]["bw_bytes"]+x["write"]["bw_bytes"] for x in j); print(round(io), round(bw/1e6,1))'
}

JOBS=(
	"randread-4k-qd1   --rw=randread --bs=4k --iodepth=1"
	"randread-4k-qd16  --rw=randread --bs=4k --iodepth=16"
	"randwrite-4k-qd1  --rw=randwrite --bs=4k --iodepth=1"
	"randwrite-4k-qd16 --rw=randwrite --bs=4k --iodepth=16"
	"write-1m-qd1      --rw=write --bs=1M --iodepth=1"
	"read-1m-qd1       --rw=read --bs=1M --iodepth=1"
)
printf '%-18s %9s %9s %11s %s\n' job IOPS MB/s "cpu us/req" "runs (IOPS)"
for job in "${JOBS[@]}"; do
	name=${job%% *}; args=${job#* }
	[[ -z "${ONLY:-}" || "$name" =~ $ONLY ]] || continue
	declare -a io=() bw=() cpu=() pio=() pbw=() pcpu=()
	for _ in $(seq "$REPS"); do
		t0=$(node_ticks)
		read -r i b <<<"$(run_fio --ioengine=nbd --uri="$URI" --size="$SIZE" $args)"
		t1=$(node_ticks)
		io+=("$i"); bw+=("$b")
		cpu+=("$(python3 -c "n=$i*$RUNTIME; print(round(($t1-$t0)/$HZ*1e6/n,1) if n else 0)")")
		if [ "$PEER" = ceph ]; then
			t0=$(ceph_ticks)
			read -r i b <<<"$(run_fio $RBD --size="$SIZE" $args)"
			t1=$(ceph_ticks)
			pio+=("$i"); pbw+=("$b")
			pcpu+=("$(python3 -c "n=$i*$RUNTIME; print(round(($t1-$t0)/$HZ*1e6/n,1) if n else 0)")")
		fi
	done
	mi=$(median "${io[@]}"); mb=$(median1 "${bw[@]}"); mc=$(median1 "${cpu[@]}")
	printf '%-18s %9s %9s %11s (%s)\n' "$name" "$mi" "$mb" "$mc" "${io[*]}"
	if [ "$PEER" = ceph ]; then
		pi=$(median "${pio[@]}"); pb=$(median1 "${pbw[@]}"); pc=$(median1 "${pcpu[@]}")
		printf '%-18s %9s %9s %11s (%s)  ovis/ceph %s\n' "  ceph rbd" "$pi" "$pb" "$pc" "${pio[*]}" "$(ratio "$mi" "$pi")"
	fi
done
echo "node RSS (MiB): $(node_rss)"
