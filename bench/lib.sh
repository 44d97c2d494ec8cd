# Shared helpers for the side-by-side benchmarks: build ovis, start an NBD
# server (ovis or qemu-nbd) on a unix socket, run fio against it, and
# summarise with medians. Sourced by the bench/*.sh scripts.
set -euo pipefail

BENCH_DIR=${BENCH_DIR:-$(mktemp -d /var/tmp/ovis-bench.XXXXXX)}
OVIS=${OVIS:-$BENCH_DIR/ovis}
export PATH=$PATH:/usr/local/go/bin

need_tools() {
	local missing=()
	for t in qemu-img qemu-nbd fio python3; do
		command -v "$t" >/dev/null || missing+=("$t")
	done
	if ((${#missing[@]})); then
		echo "installing qemu-utils fio python3 for ${missing[*]}" >&2
		sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
		$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq qemu-utils fio python3 >/dev/null
	fi
}

# build_ovis builds ovis from this tree into $OVIS, or takes the binary
# OVIS_BIN names (a before/after comparison: the same script, two
# builds).
build_ovis() {
	if [ -n "${OVIS_BIN:-}" ]; then
		cp "$OVIS_BIN" "$OVIS"
		return
	fi
	(cd "$(dirname "${BASH_SOURCE[0]}")/.." && go build -o "$OVIS" ./cmd/ovis)
}

SERVER_PID=""
# start_server KIND SOCKET ARGS... — KIND is ovis or qemu; ARGS are the
# server's own flags and the image. Waits until the socket accepts.
start_server() {
	local kind=$1 sock=$2; shift 2
	rm -f "$sock"
	case $kind in
	ovis) "$OVIS" nbd -k "$sock" -t "$@" 2>"$BENCH_DIR/server.log" & ;;
	qemu) qemu-nbd -k "$sock" -t "$@" 2>"$BENCH_DIR/server.log" & ;;
	esac
	SERVER_PID=$!
	for _ in $(seq 200); do
		[ -S "$sock" ] && return 0
		sleep 0.05
	done
	echo "server $kind did not start:" >&2
	cat "$BENCH_DIR/server.log" >&2
	return 1
}

stop_server() {
	if [ -n "$SERVER_PID" ]; then
		kill "$SERVER_PID" 2>/dev/null || true
		wait "$SERVER_PID" 2>/dev/null || true
		SERVER_PID=""
	fi
}
trap stop_server EXIT

# fio_iops SOCKET RUNTIME FIO-ARGS... — prints read+write IOPS.
fio_iops() {
	local sock=$1 runtime=$2; shift 2
	fio --name=b --ioengine=nbd --uri="nbd+unix:///?socket=$sock" \
		--time_based --runtime="$runtime" --ramp_time=1 --output-format=json "$@" 2>/dev/null |
		python3 -c 'import json,sys; j=json.loads((lambda t: t[t.index("{"):])(sys.stdin.read()))["jobs"]; print(round(sum(x["read"]["iops"]+x["write"]["iops"] for x in j)))'
}

# server_cpu_ticks — the CPU time (user+system, all threads) the running
# server has used so far, in clock ticks.
server_cpu_ticks() {
	awk '{print $14 + $15}' "/proc/$SERVER_PID/stat"
}

# cpu_us_per_req TICKS IOPS SECONDS — server CPU microseconds per request,
# from the ticks a run of SECONDS at IOPS used.
cpu_us_per_req() {
	python3 -c "import os; t=$1/os.sysconf('SC_CLK_TCK'); n=$2*$3; print(f'{t*1e6/n:.1f}' if n else 'n/a')"
}

# median N... — the median of its arguments.
median() {
	printf '%s\n' "$@" | sort -n | python3 -c 'import sys; v=[float(l) for l in sys.stdin if l.strip()]; v.sort(); n=len(v); print(round(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2))'
}

# median1 N... — the median of its arguments, to one decimal.
median1() {
	printf '%s\n' "$@" | python3 -c 'import sys; v=sorted(float(l) for l in sys.stdin if l.strip() and l.strip() != "n/a"); n=len(v); print("n/a" if not n else f"{(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2):.1f}")'
}

ratio() { python3 -c "print(f'{$1/$2:.2f}' if $2 else 'n/a')"; }

# The cluster helpers: three `ovis node`s on loopback, data on tmpfs.
PIDS=()
# cluster_dir NAME — makes TMP (CLUSTER_TMPFS, or a folder of /dev/shm
# named after NAME) for the nodes' data; at exit every process in PIDS is
# stopped and TMP removed.
cluster_dir() {
	TMP=${CLUSTER_TMPFS:-/dev/shm/ovis-bench-$1.$$}
	mkdir -p "$TMP"
	trap cleanup EXIT
}

# stop_nodes — stops every process in PIDS and waits for it.
stop_nodes() {
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	PIDS=()
}

cleanup() {
	stop_server
	stop_nodes
	rm -rf "$TMP"
}

# port — prints a loopback TCP port that was free a moment ago.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# node_ports — sets L[1..3], the nodes' listen addresses.
node_ports() {
	L=()
	for i in 1 2 3; do L[$i]=127.0.0.1:$(port); done
}

# start_node I LISTEN ARGS... — starts node I with its data in $TMP/nI and
# waits until it serves; exits the script when it does not start.
start_node() {
	local i=$1 listen=$2
	shift 2
	"$OVIS" node --dir "$TMP/n$i" --listen "$listen" --log-level warn "$@" >"$TMP/n$i.out" 2>"$TMP/n$i.log" &
	PIDS+=($!)
	for _ in $(seq 300); do
		grep -q "serving on" "$TMP/n$i.out" 2>/dev/null && return 0
		sleep 0.1
	done
	echo "node $i did not start:" >&2
	cat "$TMP/n$i.log" >&2
	exit 1
}

# start_nodes VDI SIZE — starts three nodes on L[1..3], each advertised as
# P[i] when set (a delay proxy in front of it), the first embedding etcd
# and serving NBD on 127.0.0.1:$NBD (NBD is set here); formats the
# cluster with copies 3 and creates VDI.
start_nodes() {
	local vdi=$1 size=$2 e1 e2 i
	e1=$(port)
	e2=$(port)
	NBD=$(port)
	start_node 1 "${L[1]}" --advertise "${P[1]:-${L[1]}}" --etcd-listen "http://127.0.0.1:$e1" --etcd-peer "http://127.0.0.1:$e2" --nbd "127.0.0.1:$NBD"
	for i in 2 3; do
		start_node "$i" "${L[$i]}" --advertise "${P[$i]:-${L[$i]}}" --etcd "http://127.0.0.1:$e1"
	done
	sleep 1
	"$OVIS" cluster format --copies 3 -a "${L[1]}" >/dev/null
	"$OVIS" vdi create "$vdi" "$size" -a "${L[1]}" >/dev/null
}
