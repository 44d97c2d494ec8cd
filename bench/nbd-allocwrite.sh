#!/usr/bin/env bash
# 4 KiB random writes (fio, ioengine=nbd, iodepth 16) into a fresh, empty
# qcow2 image, so that nearly every write allocates a cluster: the path
# that the metadata overlap check guards. `ovis nbd` and `qemu-nbd` run in
# turn on their own fresh image each time. Prints median IOPS per server,
# the ratio ovis/qemu, and the server CPU per request.
#
# Usage: bench/nbd-allocwrite.sh [SIZE (default 4G)] [RUNTIME s (default 8)] [REPS (default 3)]
# OVIS=path/to/ovis compares another build (the default builds this tree).
source "$(dirname "$0")/lib.sh"
SIZE=${1:-4G}
RUNTIME=${2:-8}
REPS=${3:-3}
need_tools
[ -x "$OVIS" ] || build_ovis
cd "$BENCH_DIR"
sock=$BENCH_DIR/nbd.sock

declare -a o=() q=() oc=() qc=()
for _ in $(seq "$REPS"); do
	for kind in ovis qemu; do
		rm -f disk.qcow2
		qemu-img create -q -f qcow2 disk.qcow2 "$SIZE"
		start_server "$kind" "$sock" -f qcow2 --cache=writeback disk.qcow2
		t0=$(server_cpu_ticks)
		iops=$(fio_iops "$sock" "$RUNTIME" --rw=randwrite --bs=4k --iodepth=16)
		cpu=$(cpu_us_per_req $(($(server_cpu_ticks) - t0)) "$iops" "$((RUNTIME + 1))")
		stop_server
		if [ "$kind" = ovis ]; then o+=("$iops"); oc+=("$cpu"); else q+=("$iops"); qc+=("$cpu"); fi
	done
done
mo=$(median "${o[@]}"); mq=$(median "${q[@]}")
printf '%-22s %10s %10s %7s\n' workload ovis qemu ratio
printf '%-22s %10s %10s %7s   (ovis %s; qemu %s)\n' "alloc randwrite 4k" "$mo" "$mq" "$(ratio "$mo" "$mq")" "${o[*]}" "${q[*]}"
printf '%-22s %10s %10s          (µs per request, ovis %s; qemu %s)\n' "server CPU" "$(median1 "${oc[@]}")" "$(median1 "${qc[@]}")" "${oc[*]}" "${qc[*]}"
