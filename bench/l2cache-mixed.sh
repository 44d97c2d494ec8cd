#!/usr/bin/env bash
# The second workload of the L2-cache study, where eviction policies should
# differ: a hot set read at random (the first 4 GiB of a 40 GiB image: 8 L2
# tables) while a cold scan strides across the whole disk (a new L2 table
# every few reads). Cache: 24 entries (12 GiB of 40), host cache off. LRU
# lets the scan push the hot tables out; a hit count keeps them. Prints the
# hot job's IOPS and the total per policy, and qemu-nbd's.
#
# Usage: bench/l2cache-mixed.sh [RUNTIME s (default 10)] [REPS (default 3)]
# Environment: ENTRIES (default 24), HOT_GIB (the hot set, default 4),
# STRIDE (the scan's gap between reads, default 64M; 512M makes every scan
# read a new table).
source "$(dirname "$0")/lib.sh"
RUNTIME=${1:-10}
REPS=${2:-3}
ENTRIES=${ENTRIES:-24}
HOT_GIB=${HOT_GIB:-4}
STRIDE=${STRIDE:-64M}
need_tools
build_ovis
cd "$BENCH_DIR"
[ -f d40.qcow2 ] || qemu-img create -f qcow2 -o preallocation=metadata,cluster_size=65536 d40.qcow2 40G >/dev/null
sock=$BENCH_DIR/nbd.sock
bytes=$((ENTRIES * 65536))

# hot_cold SOCKET: prints "hot total" IOPS.
hot_cold() {
	fio --ioengine=nbd --uri="nbd+unix:///?socket=$1" --time_based --runtime="$RUNTIME" --ramp_time=1 \
		--output-format=json \
		--name=hot --rw=randread --bs=4k --iodepth=8 --offset=0 --size="${HOT_GIB}G" \
		--name=cold --rw=read:"$STRIDE" --bs=4k --iodepth=8 --offset="${HOT_GIB}G" --size="$((40 - HOT_GIB))G" 2>/dev/null |
		python3 -c 'import json,sys; j={x["jobname"]:x["read"]["iops"] for x in json.loads((lambda t: t[t.index("{"):])(sys.stdin.read()))["jobs"]}; print(round(j["hot"]), round(j["hot"]+j["cold"]))'
}

printf '%-16s %10s %10s   (runs: hot/total)\n' server hot total
for s in lru hitcount hitcount-floor qemu; do
	hots=() tots=() all=()
	for _ in $(seq "$REPS"); do
		if [ "$s" = qemu ]; then
			# -e 2: each fio job is a connection of its own; with the
			# default of 1 the second would wait for the first to leave.
			start_server qemu "$sock" -e 2 --image-opts "driver=qcow2,file.driver=file,file.filename=d40.qcow2,cache.direct=on,l2-cache-size=$bytes"
		else
			start_server ovis "$sock" -e 2 -f qcow2 --cache=none --l2-cache-size="$bytes" --l2-cache-policy="$s" d40.qcow2
		fi
		read -r h t < <(hot_cold "$sock")
		stop_server
		hots+=("$h") tots+=("$t") all+=("$h/$t")
	done
	printf '%-16s %10s %10s   (%s)\n' "$s" "$(median "${hots[@]}")" "$(median "${tots[@]}")" "${all[*]}"
done
