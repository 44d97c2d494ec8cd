#!/usr/bin/env bash
# Times `ovis img convert` against `qemu-img convert` on the same files:
# qcow2->raw and raw->qcow2 on a 2 GiB image that is half data (1 MiB runs
# of mixed, partly compressible bytes) and half holes, and raw->qcow2
# compressed with zlib and with zstd, each with qemu-img's default in-order
# writes and with -W. The two tools run in turn, REPS times each (the
# order alternates between repetitions); the table gives the median wall
# time of each and the ratio qemu/ovis (above 1: ovis is faster).
#
# The machine is shared and the page cache cannot be dropped here: the
# source is read from the page cache by both tools after the first run,
# and both write their output into the page cache without syncing
# (qemu-img convert's default cache mode, unsafe, which ovis follows).
# Each run starts after a sync, so that no run pays for the write-back of
# the one before.
#
# Usage: bench/convert.sh [REPS (default 3)]
# Environment: CASES (space separated, default: q2r r2q r2q-c r2q-zstd
# r2q-c-W r2q-zstd-W; also q2r-W r2q-W), SIZE_MIB (default 2048).
# Output: a table on stdout, CSV in $BENCH_DIR/convert.csv.
source "$(dirname "$0")/lib.sh"
REPS=${1:-3}
SIZE_MIB=${SIZE_MIB:-2048}
CASES=${CASES:-"q2r r2q r2q-c r2q-zstd r2q-c-W r2q-zstd-W"}
need_tools
build_ovis
cd "$BENCH_DIR"

# The source: data in every other MiB, from a 64 MiB corpus of the
# machine's libraries and documentation (compresses about 2-3x).
if [ ! -f src.raw ]; then
	# (head ends the pipe early on purpose: no pipefail here.)
	(set +o pipefail; find /usr/lib /usr/share/doc -type f -size +16k 2>/dev/null | sort | head -4000 |
		xargs cat 2>/dev/null | head -c $((64 << 20)) >corpus)
	python3 - "$SIZE_MIB" <<'EOF'
import sys
mib = 1 << 20
size = int(sys.argv[1]) * mib
corpus = open("corpus", "rb").read()
with open("src.raw", "wb") as f:
    f.truncate(size)
    for i in range(0, size // mib, 2):
        at = (i * 7919 * mib) % (len(corpus) - mib)
        f.seek(i * mib)
        f.write(corpus[at:at + mib])
EOF
	qemu-img convert -O qcow2 src.raw src.qcow2
fi

# args CASE — prints: SOURCE OUTPUT CONVERT-ARGS...
args() {
	case $1 in
	q2r) echo "src.qcow2 out.raw -O raw" ;;
	r2q) echo "src.raw out.qcow2 -O qcow2" ;;
	r2q-c) echo "src.raw out.qcow2 -O qcow2 -c" ;;
	r2q-zstd) echo "src.raw out.qcow2 -O qcow2 -c -o compression_type=zstd" ;;
	r2q-c-W) echo "src.raw out.qcow2 -O qcow2 -c -W" ;;
	r2q-zstd-W) echo "src.raw out.qcow2 -O qcow2 -c -W -o compression_type=zstd" ;;
	q2r-W) echo "src.qcow2 out.raw -O raw -W" ;;
	r2q-W) echo "src.raw out.qcow2 -O qcow2 -W" ;;
	*) echo "unknown case $1" >&2; return 1 ;;
	esac
}

# timed TOOL SRC DST ARGS... — prints the wall time of one conversion.
timed() {
	local tool=$1 src=$2 dst=$3; shift 3
	rm -f "$dst"
	# Start each run with no dirty pages of earlier runs being written
	# back under it.
	sync
	local t0 t1
	t0=$(date +%s.%N)
	case $tool in
	ovis) "$OVIS" img convert "$@" "$src" "$dst" ;;
	qemu) qemu-img convert "$@" "$src" "$dst" ;;
	esac
	t1=$(date +%s.%N)
	python3 -c "print(f'{$t1 - $t0:.3f}')"
}

csv=$BENCH_DIR/convert.csv
echo "case,tool,rep,seconds" >"$csv"
# Warm the page cache with the sources.
cat src.raw src.qcow2 >/dev/null
printf '%-12s %10s %10s %8s\n' case ovis_s qemu_s qemu/ovis
for c in $CASES; do
	read -r src dst rest <<<"$(args "$c")"
	# shellcheck disable=SC2206
	cargs=($rest)
	o=() q=()
	for r in $(seq "$REPS"); do
		if ((r % 2)); then order="ovis qemu"; else order="qemu ovis"; fi
		for tool in $order; do
			t=$(timed "$tool" "$src" "$dst" "${cargs[@]}")
			echo "$c,$tool,$r,$t" >>"$csv"
			if [ "$tool" = ovis ]; then o+=("$t"); else q+=("$t"); fi
		done
	done
	mo=$(printf '%s\n' "${o[@]}" | sort -n | python3 -c 'import sys; v=sorted(float(l) for l in sys.stdin); n=len(v); print(f"{(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2):.3f}")')
	mq=$(printf '%s\n' "${q[@]}" | sort -n | python3 -c 'import sys; v=sorted(float(l) for l in sys.stdin); n=len(v); print(f"{(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2):.3f}")')
	printf '%-12s %10s %10s %8s\n' "$c" "$mo" "$mq" "$(ratio "$mq" "$mo")"
done
rm -f out.raw out.qcow2
