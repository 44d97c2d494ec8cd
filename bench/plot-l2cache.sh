#!/usr/bin/env bash
# Plots bench/l2cache.sh's CSV: IOPS against L2 cache entries, one line per
# policy plus qemu-nbd, one panel per disk size, for one variant.
# Usage: bench/plot-l2cache.sh CSV VARIANT OUT.png
set -euo pipefail
csv=$1 variant=$2 out=$3
command -v gnuplot >/dev/null || { echo "needs gnuplot (apt-get install gnuplot-nox)" >&2; exit 1; }
tmp=$(mktemp -d)
for s in ovis-lru ovis-hitcount ovis-hitcount-floor qemu; do
	for g in 20 40; do
		awk -F, -v v="$variant" -v g="$g" -v s="$s" '$1==v && $2==g && $4==s && $5>0 {print $3, $5}' "$csv" | sort -n >"$tmp/$s-$g.dat"
	done
done
gnuplot <<GP
set terminal pngcairo size 1100,450 font ",10"
set output "$out"
set multiplot layout 1,2 title "4 KiB random reads, iodepth 16, $variant: IOPS against L2 cache entries (64 KiB clusters)"
set key top left
set xlabel "L2 cache entries"
set ylabel "IOPS"
set grid
do for [g in "20 40"] {
  set title g." GiB disk (".(g*2)." L2 tables)"
  plot "$tmp/ovis-lru-".g.".dat" w lp t "ovis lru", \
       "$tmp/ovis-hitcount-".g.".dat" w lp t "ovis hitcount (QEMU's original)", \
       "$tmp/ovis-hitcount-floor-".g.".dat" w lp t "ovis hitcount-floor", \
       "$tmp/qemu-".g.".dat" w lp dt 2 t "qemu-nbd (lru)"
}
unset multiplot
GP
rm -rf "$tmp"
