#!/usr/bin/env bash
# 4 KiB random reads (fio, ioengine=nbd, iodepth 16) against `ovis nbd` and
# `qemu-nbd` in turn, on a raw file and on a fully allocated qcow2 image.
# Prints median IOPS per server and the ratio ovis/qemu.
#
# Usage: bench/nbd-randread.sh [SIZE (default 1G)] [RUNTIME s (default 10)] [REPS (default 3)]
source "$(dirname "$0")/lib.sh"
SIZE=${1:-1G}
RUNTIME=${2:-10}
REPS=${3:-3}
need_tools
build_ovis
cd "$BENCH_DIR"
qemu-img create -f raw disk.raw "$SIZE" >/dev/null
# Fill with data so that every read hits allocated, non-zero blocks.
fio --name=fill --filename=disk.raw --rw=write --bs=1M --size="$SIZE" --buffer_compress_percentage=0 >/dev/null
qemu-img convert -f raw -O qcow2 -o preallocation=full disk.raw disk.qcow2
sock=$BENCH_DIR/nbd.sock

printf '%-8s %-8s %10s %10s %7s\n' image cache ovis qemu ratio
for fmt in raw qcow2; do
	for cache in writeback none; do
		declare -a o=() q=()
		for _ in $(seq "$REPS"); do
			start_server ovis "$sock" -f "$fmt" --cache="$cache" "disk.$fmt"
			o+=("$(fio_iops "$sock" "$RUNTIME" --rw=randread --bs=4k --iodepth=16)")
			stop_server
			start_server qemu "$sock" -f "$fmt" --cache="$cache" "disk.$fmt"
			q+=("$(fio_iops "$sock" "$RUNTIME" --rw=randread --bs=4k --iodepth=16)")
			stop_server
		done
		mo=$(median "${o[@]}"); mq=$(median "${q[@]}")
		printf '%-8s %-8s %10s %10s %7s   (ovis %s; qemu %s)\n' "$fmt" "$cache" "$mo" "$mq" "$(ratio "$mo" "$mq")" "${o[*]}" "${q[*]}"
	done
done
