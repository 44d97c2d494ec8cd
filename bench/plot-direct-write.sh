#!/usr/bin/env bash
# Plots bench/direct-write.sh's CSV (CSV=FILE): median MB/s against the
# added one-way delay for writeback, emulated and native, one row of
# panels per write size and one panel per delayed path, with the upper
# limit (one raw file on tmpfs served by `ovis nbd`, the delay on the
# client's path) dashed for each mode.
# Usage: bench/plot-direct-write.sh CSV OUT.png
set -euo pipefail
csv=$1 out=$2
command -v gnuplot >/dev/null || { echo "needs gnuplot (apt-get install gnuplot-nox)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The delays on an even axis, in the order the script ran them.
delays=$(awk -F, 'NR>1 && !seen[$3]++ {print $3}' "$csv" | tr '\n' ' ')
sizes=$(awk -F, 'NR>1 && !seen[$1]++ {print $1}' "$csv" | tr '\n' ' ')
paths=$(awk -F, 'NR>1 && $2!="local" && !seen[$2]++ {print $2}' "$csv" | tr '\n' ' ')
for s in $sizes; do
	for p in local $paths; do
		for m in writeback emulated native; do
			col=$(awk -v m="$m" 'BEGIN{print m=="writeback"?5:m=="emulated"?6:7}')
			awk -F, -v s="$s" -v p="$p" -v c="$col" -v ds="$delays" '
				BEGIN { n = split(ds, d, " "); for (i = 1; i <= n; i++) x[d[i]] = i - 1 }
				NR>1 && $1==s && $2==p && $c!="n/a" { print x[$3], $c }' "$csv" | sort -n >"$tmp/$s-$p-$m.dat"
		done
	done
done
xtics=$(echo "$delays" | awk '{for (i = 1; i <= NF; i++) printf "%s\"%s\" %d", (i>1?", ":""), ($i=="0"?"0":$i), i-1}')
ncols=$(echo "$paths" | wc -w)
nrows=$(echo "$sizes" | wc -w)
gnuplot <<GP
set terminal pngcairo size $((400 * (ncols < 2 ? 2 : ncols) + 60)),$((330 * nrows + 80)) font ",9"
set output "$out"
set multiplot layout $nrows,$ncols title "Direct writes: qemu-img bench -w -d 1, 3 nodes on tmpfs, copies 3, median MB/s\\ndashed: the upper limit, one raw file on tmpfs served by ovis nbd (delay on the client's path)"
set logscale y
set grid
set key bottom left font ",8"
set xtics ($xtics)
set xrange [-0.2:$(($(echo "$delays" | wc -w) - 1)).2]
set xlabel "one-way delay added"
set ylabel "MB/s"
do for [s in "$sizes"] {
  do for [p in "$paths"] {
    set title s." writes, delay on: ".p
    plot "$tmp/".s."-".p."-writeback.dat" w lp lc 1 pt 7 t "writeback", \
         "$tmp/".s."-".p."-emulated.dat" w lp lc 2 pt 5 t "emulated (write+flush)", \
         "$tmp/".s."-".p."-native.dat" w lp lc 3 pt 9 t "native (FUA)", \
         "$tmp/".s."-local-writeback.dat" w l lc 1 dt 2 notitle, \
         "$tmp/".s."-local-emulated.dat" w l lc 2 dt 2 notitle, \
         "$tmp/".s."-local-native.dat" w l lc 3 dt 2 notitle
  }
}
unset multiplot
GP
