#!/usr/bin/env bash
# Sheepdog's direct-write question, measured: writeback, emulated
# writethrough (write + flush) and native writethrough (FUA) against three
# `ovis node`s on loopback, data on tmpfs, copies 3, with qemu-img bench
# through NBD. Optionally with a delaying TCP proxy (bench/delayproxy) on
# the client↔gateway path and on every node↔node path, to model separate
# hosts (the kernel here has no netem).
#
# Usage: bench/direct-write.sh [RUNS (default 5)]
#   DELAYS="0 100us 1ms 25ms"  one-way delays to run, on each path of PATHS
#   PATHS="local client nodes"
#                              local: the upper limit, one raw file on
#                                     tmpfs served by `ovis nbd` (no
#                                     replicas), the delay on the client's
#                                     path to it;
#                              client: qemu-img <-> the gateway;
#                              nodes: every node <-> node path (the
#                                     client on the gateway's host);
#                              both: client and nodes at once
#   SIZES="1M 4k"
#   CSV=FILE                   also append every row to FILE (for
#                              bench/plot-direct-write.sh)
# Prints, per size, path and delay, the median MB/s of each mode over RUNS
# runs (interleaved), the spread, and the ratios native/emulated and
# native/writeback.
source "$(dirname "$0")/lib.sh"
RUNS=${1:-5}
DELAYS=${DELAYS:-"0 1ms"}
PATHS=${PATHS:-"local client nodes"}
CSV=${CSV:-}
SIZES=${SIZES:-"1M 4k"}
need_tools
build_ovis
(cd "$(dirname "$0")/.." && go build -o "$BENCH_DIR/delayproxy" ./bench/delayproxy)
cluster_dir dw

# proxy LISTEN TO DELAY — starts a delay proxy, prints nothing.
proxy() {
	"$BENCH_DIR/delayproxy" -listen "$1" -to "$2" -delay "$3" >/dev/null 2>&1 &
	PIDS+=($!)
}

# start_cluster DELAY — three nodes; with DELAY, every node is reached by
# the others through a proxy that adds it.
start_cluster() {
	local d=$1
	node_ports
	P=()
	if [ "$d" != 0 ]; then
		for i in 1 2 3; do
			P[$i]=127.0.0.1:$(port)
			proxy "${P[$i]}" "${L[$i]}" "$d"
		done
	fi
	start_nodes dw 1G
}

# start_local — the upper limit: one raw file on tmpfs, as big as the
# VDI, served by `ovis nbd` over TCP on loopback as export dw.
start_local() {
	NBD=$(port)
	qemu-img create -q -f raw "$TMP/local.raw" 1G
	"$OVIS" nbd -t -b 127.0.0.1 -p "$NBD" -x dw -f raw "$TMP/local.raw" 2>"$TMP/local.log" &
	PIDS+=($!)
	for _ in $(seq 200); do
		python3 -c "import socket,sys; socket.create_connection(('127.0.0.1',$NBD),0.2)" 2>/dev/null && return 0
		sleep 0.05
	done
	echo "ovis nbd did not start:" >&2
	cat "$TMP/local.log" >&2
	return 1
}

stop_cluster() {
	stop_nodes
	rm -rf "$TMP"
	mkdir -p "$TMP"
}

# bench URI SIZE COUNT MODE — prints MB/s of one qemu-img bench run.
bench_run() {
	local uri=$1 size=$2 count=$3 mode=$4 args=()
	case $mode in
	writeback) args=(-t writeback) ;;
	emulated) args=(-t writeback --flush-interval=1) ;;
	native) args=(-t writethrough) ;;
	esac
	local out
	out=$(qemu-img bench -w -c "$count" -d 1 -s "$size" -f raw "${args[@]}" "$uri" 2>&1) ||
		echo "qemu-img bench $mode $size x$count on $uri failed: $out" >&2
	python3 -c "
import re,sys
m=re.search(r'Run completed in ([0-9.]+) seconds', sys.argv[1])
size={'k':1<<10,'M':1<<20}[sys.argv[2][-1]]*int(sys.argv[2][:-1])
print(f'{int(sys.argv[3])*size/float(m.group(1))/1e6:.4g}' if m else 'n/a')" "$out" "$size" "$count"
}

# median3 N... — the median, to three significant digits (4 KiB writes at
# a 50 ms round trip run at 0.08 MB/s).
median3() { printf '%s\n' "$@" | python3 -c 'import sys; v=sorted(float(l) for l in sys.stdin if l.strip() and l.strip() != "n/a"); n=len(v); m=(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2) if n else 0; print("n/a" if not n else f"{m:.3g}" if m < 1000 else f"{m:.0f}")'; }

# spread N... — min-max of the runs, for the CSV.
spread() { printf '%s\n' "$@" | python3 -c 'import sys; v=sorted(float(l) for l in sys.stdin if l.strip() and l.strip() != "n/a"); g=lambda x: f"{x:.3g}" if x < 1000 else f"{x:.0f}"; print(f"{g(v[0])}-{g(v[-1])}" if v else "n/a")'; }

count_for() { # SIZE DELAY
	local size=$1 d=$2
	case "$size:$d" in
	1M:0 | 1M:100us) echo 100 ;;
	1M:*) echo 20 ;;
	4k:0 | 4k:100us) echo 5000 ;;
	4k:1ms) echo 1000 ;;
	4k:*) echo 100 ;;
	esac
}

[ -z "$CSV" ] || [ -s "$CSV" ] || echo "size,path,delay,count,writeback,emulated,native,wb_spread,emu_spread,nat_spread" >"$CSV"
echo "# $(date -Is) ovis $(git -C "$(dirname "$0")/.." rev-parse --short HEAD); 3 nodes, copies 3, tmpfs; qemu-img bench -w -d 1; $RUNS runs per mode, interleaved; load $(cut -d' ' -f1-3 /proc/loadavg)"
"$BENCH_DIR/delayproxy" -selftest -delay 0 | sed 's/^/# proxy: /'
printf '%-5s %-7s %-6s %5s %10s %10s %10s %8s %8s  %s\n' size path delay count writeback emulated native nat/emu nat/wb "runs (wb; emu; nat)"
for path in $PATHS; do
	for d in $DELAYS; do
		case $path in
		local) start_local ;;
		nodes | both) start_cluster "$d" ;;
		client) start_cluster 0 ;;
		*) echo "unknown path $path (want local, client, nodes or both)" >&2; exit 2 ;;
		esac
		uri="nbd://127.0.0.1:$NBD/dw"
		if [ "$path" != nodes ] && [ "$d" != 0 ]; then
			C=127.0.0.1:$(port)
			proxy "$C" "127.0.0.1:$NBD" "$d"
			sleep 0.2
			uri="nbd://$C/dw"
		fi
		for size in $SIZES; do
			n=$(count_for "$size" "$d")
			declare -a wb=() em=() na=()
			for _ in $(seq "$RUNS"); do
				wb+=("$(bench_run "$uri" "$size" "$n" writeback)")
				em+=("$(bench_run "$uri" "$size" "$n" emulated)")
				na+=("$(bench_run "$uri" "$size" "$n" native)")
			done
			mw=$(median3 "${wb[@]}"); me=$(median3 "${em[@]}"); mn=$(median3 "${na[@]}")
			printf '%-5s %-7s %-6s %5s %10s %10s %10s %8s %8s  %s; %s; %s\n' "$size" "$path" "$d" "$n" "$mw" "$me" "$mn" \
				"$(ratio "$mn" "$me")" "$(ratio "$mn" "$mw")" "${wb[*]}" "${em[*]}" "${na[*]}"
			[ -z "$CSV" ] || echo "$size,$path,$d,$n,$mw,$me,$mn,$(spread "${wb[@]}"),$(spread "${em[@]}"),$(spread "${na[@]}")" >>"$CSV"
		done
		stop_cluster
	done
done
