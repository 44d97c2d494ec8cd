#!/usr/bin/env bash
# Reproduces QEMU's L2-cache study: 4 KiB random reads (fio, ioengine=nbd,
# iodepth 16) from metadata-preallocated 20 GiB and 40 GiB qcow2 images
# with 64 KiB clusters (one L2 table maps 512 MiB), for several L2 cache
# sizes, against `ovis nbd` with each eviction policy and against qemu-nbd,
# in turn within one run. Prints IOPS and the ratio ovis(lru)/qemu per row,
# and the server CPU time per request of ovis(lru) and qemu-nbd: a figure
# that a busy machine distorts less than IOPS (the run's CPU time over
# its requests, ramp included).
#
# Variants (VARIANTS, space separated): direct (host cache off, 64 KiB
# cache entries on both servers: the study's setting), default (host cache
# off, no entry size given: both then use 4 KiB entries when the cache
# cannot cover the disk, QEMU's default since the study), hostcache (page
# cache on, 64 KiB entries), slice4k (l2-cache-entry-size=4096, host
# cache off).
#
# Usage: bench/l2cache.sh [RUNTIME s (default 8)] [REPS (default 1)]
# With REPS > 1 each cell is the median of REPS runs.
# Output: a table on stdout and CSV rows appended to $BENCH_DIR/l2cache.csv.
source "$(dirname "$0")/lib.sh"
RUNTIME=${1:-8}
REPS=${2:-1}
VARIANTS=${VARIANTS:-"direct default hostcache slice4k"}
POLICIES=${POLICIES:-"lru hitcount hitcount-floor"}
# ROWS: DISK_GIB:ENTRIES pairs, the study's by default.
ROWS=${ROWS:-"20:16 20:24 20:32 20:40 40:16 40:40 40:72 40:78 40:80"}
need_tools
build_ovis
cd "$BENCH_DIR"
for g in 20 40; do
	[ -f "d$g.qcow2" ] || qemu-img create -f qcow2 -o preallocation=metadata,cluster_size=65536 "d$g.qcow2" "${g}G" >/dev/null
done
sock=$BENCH_DIR/nbd.sock
csv=$BENCH_DIR/l2cache.csv
header="variant,disk_gib,entries,server,iops,cpu_us_per_req"
[ -s "$csv" ] && [ "$(head -1 "$csv")" != "$header" ] && csv=$BENCH_DIR/l2cache-cpu.csv
[ -s "$csv" ] || echo "$header" >"$csv"

# once SERVER-KIND ARGS... ; prints IOPS:CPU-µs-PER-REQUEST of one fio run.
once() {
	local kind=$1; shift
	start_server "$kind" "$sock" "$@"
	local t0 t1 iops
	t0=$(server_cpu_ticks)
	iops=$(fio_iops "$sock" "$RUNTIME" --rw=randread --bs=4k --iodepth=16 || echo 0)
	t1=$(server_cpu_ticks)
	stop_server
	echo "$iops:$(cpu_us_per_req $((t1 - t0)) "$iops" $((RUNTIME + 1)))"
}

for variant in $VARIANTS; do
	echo "== $variant"
	printf '%-5s %-7s' disk entries
	for p in $POLICIES; do printf ' %14s' "$p"; done
	printf ' %10s %7s %9s %9s\n' qemu lru/qemu "µs lru" "µs qemu"
	for row in $ROWS; do
		g=${row%%:*} n=${row##*:}
		bytes=$((n * 65536))
		ocache=none qdirect=on slice=65536
		case $variant in
		hostcache) ocache=writeback qdirect=off ;;
		slice4k) slice=4096 ;;
		default) slice="" ;;
		esac
		oslice=() qslice=""
		if [ -n "$slice" ]; then
			oslice=(--l2-cache-entry-size="$slice") qslice=",l2-cache-entry-size=$slice"
		fi
		printf '%-5s %-7s' "${g}G" "$n"
		# Repetitions are interleaved across the servers so that a noisy
		# minute on the shared machine hits all of them alike.
		declare -A v=()
		for _ in $(seq "$REPS"); do
			for p in $POLICIES; do
				v[$p]+=" $(once ovis -f qcow2 --cache="$ocache" --l2-cache-size="$bytes" \
					"${oslice[@]}" --l2-cache-policy="$p" "d$g.qcow2")"
			done
			v[qemu]+=" $(once qemu --image-opts \
				"driver=qcow2,file.driver=file,file.filename=d$g.qcow2,cache.direct=$qdirect,l2-cache-size=$bytes$qslice")"
		done
		declare -A r=() c=()
		for p in $POLICIES qemu; do
			local_iops=() local_cpu=()
			for x in ${v[$p]}; do
				local_iops+=("${x%%:*}") local_cpu+=("${x##*:}")
			done
			r[$p]=$(median "${local_iops[@]}")
			c[$p]=$(median1 "${local_cpu[@]}")
			[ "$p" = qemu ] || printf ' %14s' "${r[$p]}"
			echo "$variant,$g,$n,$([ "$p" = qemu ] && echo qemu || echo "ovis-$p"),${r[$p]},${c[$p]}" >>"$csv"
		done
		q=${r[qemu]}
		printf ' %10s %7s %9s %9s\n' "$q" "$(ratio "${r[lru]:-0}" "$q")" "${c[lru]:-n/a}" "${c[qemu]}"
	done
done
echo "csv: $csv"
