#!/usr/bin/env bash
# The cost of the allocation map (issue 26): first writes into a fresh
# VDI mark their objects in etcd before any replica gets data. Two ovis
# builds in turn, REPS rounds interleaved, each on three fresh nodes
# (lib.sh's start_nodes: data on tmpfs, copies 3, embedded etcd): fio
# 1 MiB sequential writes at QD8 over the whole fresh VDI (every object
# written first), then 4 KiB random writes at QD16 for RUNTIME seconds
# into a second fresh VDI (first writes scattered over many objects).
# Prints the medians and the ratio after/before.
#
# Usage: bench/alloc-fill.sh BEFORE-REV AFTER-REV [VDI SIZE (1G)] [RUNTIME s (10)] [REPS (3)]
source "$(dirname "$0")/lib.sh"
BEFORE=$1 AFTER=$2 SIZE=${3:-1G} RUNTIME=${4:-10} REPS=${5:-3}
need_tools
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
build_at() { # REV OUT
	local wt
	wt=$(mktemp -d)
	git -C "$ROOT" worktree add -q --detach "$wt" "$1"
	(cd "$wt" && go build -o "$2" ./cmd/ovis)
	git -C "$ROOT" worktree remove --force "$wt"
}
build_at "$BEFORE" "$BENCH_DIR/ovis-before"
build_at "$AFTER" "$BENCH_DIR/ovis-after"
echo "# $(date -Is) before $(git -C "$ROOT" rev-parse --short "$BEFORE"), after $(git -C "$ROOT" rev-parse --short "$AFTER"); 3 nodes, copies 3, tmpfs; VDI $SIZE; load $(cut -d' ' -f1-3 /proc/loadavg)"
fio_json() { python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"]; print(round(sum(x["write"]["iops"] for x in j)), round(sum(x["write"]["bw_bytes"] for x in j)/1e6,1))'; }
declare -A FILL RAND
for r in $(seq "$REPS"); do
	for which in before after; do
		OVIS=$BENCH_DIR/ovis-$which
		cluster_dir "alloc-$which-$r"
		node_ports
		start_nodes fill "$SIZE"
		"$OVIS" vdi create rand "$SIZE" -a "${L[1]}" >/dev/null
		f=$(fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$NBD/fill" --rw=write --bs=1M --iodepth=8 --size=100% --output-format=json 2>/dev/null | fio_json)
		q=$(fio --name=rand --ioengine=nbd --uri="nbd://127.0.0.1:$NBD/rand" --rw=randwrite --bs=4k --iodepth=16 --time_based --runtime="$RUNTIME" --output-format=json 2>/dev/null | fio_json)
		FILL[$which]+="$(echo "$f" | cut -d' ' -f2) "
		RAND[$which]+="$(echo "$q" | cut -d' ' -f1) "
		echo "round $r $which: fill ${f#* } MB/s, first-write randwrite 4k qd16 ${q% *} IOPS"
		stop_nodes
		rm -rf "$TMP"
	done
done
med() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
fb=$(echo "${FILL[before]}" | med) fa=$(echo "${FILL[after]}" | med)
rb=$(echo "${RAND[before]}" | med) ra=$(echo "${RAND[after]}" | med)
printf "%-40s %10s %10s %7s\n" job before after ratio
printf "%-40s %10s %10s %7.2f\n" "fill 1M seq qd8 (MB/s)" "$fb" "$fa" "$(echo "$fa / $fb" | bc -l)"
printf "%-40s %10s %10s %7.2f\n" "first-write randwrite 4k qd16 (IOPS)" "$rb" "$ra" "$(echo "$ra / $rb" | bc -l)"
