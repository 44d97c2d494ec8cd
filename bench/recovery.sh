#!/usr/bin/env bash
# Recovery, timed as Sheepdog's figures were: four `ovis node`s on tmpfs,
# copies 3, one VDI of SIZE (780M, as Sheepdog's) full of random data.
#
#   1. the machine's raw copy speed: cp of SIZE on the same tmpfs;
#   2. SIGKILL of node 4 during a QD1 4 KiB fio write: the time to the
#      new epoch (from the kill to the first node's log of it), the
#      client's longest write (fio's max completion latency), and the
#      re-replication (from the kill until every node logged its recovery
#      of the new epoch done), with the bytes pulled;
#   3. node 4 restarted with its data: after that outage (writes went on
#      meanwhile), then killed and restarted again with nothing changed:
#      the time from its start until every node is recovered;
#   4. node 4 killed, the whole VDI overwritten, node 4 restarted: the
#      same, with what it pulled;
#   5. a VM's 4 KiB random reads (fio, QD8) alone, while recovery runs
#      unthrottled, and while it runs throttled (RATE, default 64M/s per
#      node).
#
# Usage: bench/recovery.sh [SIZE (default 780M)]
# Prints one line per figure; docs/benchmarks.md has the table beside
# Sheepdog's.
source "$(dirname "$0")/lib.sh"
SIZE=${1:-780M}
need_tools
build_ovis
TMP=${CLUSTER_TMPFS:-/dev/shm/ovis-bench-rec.$$}
mkdir -p "$TMP"
PIDS=()
declare -A PID
cleanup() {
	for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	[ -n "${KEEP:-}" ] && { echo "kept $TMP" >&2; return; }
	rm -rf "$TMP"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }

E1=$(port); E2=$(port); NBD=$(port)
for i in 1 2 3 4; do L[$i]=127.0.0.1:$(port); done

start_node() { # I
	local i=$1 extra=(--etcd "http://127.0.0.1:$E1")
	[ "$i" = 1 ] && extra=(--etcd-listen "http://127.0.0.1:$E1" --etcd-peer "http://127.0.0.1:$E2" --nbd "127.0.0.1:$NBD")
	: >"$TMP/n$i.out"
	"$OVIS" node --dir "$TMP/n$i" --listen "${L[$i]}" --log-level info "${extra[@]}" >"$TMP/n$i.out" 2>>"$TMP/n$i.log" &
	PID[$i]=$!
	PIDS+=($!)
	for _ in $(seq 300); do grep -q "serving on" "$TMP/n$i.out" 2>/dev/null && return 0; sleep 0.02; done
	echo "node $i did not start" >&2
	cat "$TMP/n$i.log" >&2
	return 1
}

# epoch — the cluster's epoch.
epoch() { "$OVIS" cluster info -a "${L[1]}" --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["epoch"])'; }

# all_recovered N — true when N nodes are up and each has recovered its epoch.
all_recovered() {
	"$OVIS" node list -a "${L[1]}" --output json | python3 -c '
import json,sys
ns=json.load(sys.stdin)
sys.exit(0 if len(ns)==int(sys.argv[1]) and all(n["state"]=="up" and n["recovery"]["done"]>=n["epoch"] for n in ns) else 1)' "$1"
}

wait_recovered() { # N
	for _ in $(seq 3000); do all_recovered "$1" && return 0; sleep 0.02; done
	echo "recovery did not end" >&2
	return 1
}

# logged MSG EPOCH NODES... — the latest time (Unix seconds) at which each
# of NODES logged MSG for EPOCH, and the sum of their bytes=.
logged() {
	local msg=$1 ep=$2; shift 2
	local files=()
	for i in "$@"; do files+=("$TMP/n$i.log"); done
	python3 - "$msg" "$ep" "${files[@]}" <<'EOF'
import re, sys, datetime
msg, ep, files = sys.argv[1], sys.argv[2], sys.argv[3:]
last, total = 0.0, 0
for f in files:
    t = None
    for line in open(f):
        if f'msg="{msg}"' not in line or not re.search(rf'\bepoch={ep}\b', line):
            continue
        ts = re.search(r'time=(\S+)', line).group(1)
        t = datetime.datetime.fromisoformat(ts).timestamp()
        b = re.search(r'\bbytes=(\d+)', line)
        total += int(b.group(1)) if b else 0
    if t is None:
        print("missing", f, file=sys.stderr); sys.exit(1)
    last = max(last, t)
print(f"{last:.6f} {total}")
EOF
}

# first_logged MSG EPOCH NODES... — the earliest time any of NODES logged MSG for EPOCH.
first_logged() {
	local msg=$1 ep=$2; shift 2
	local files=()
	for i in "$@"; do files+=("$TMP/n$i.log"); done
	python3 - "$msg" "$ep" "${files[@]}" <<'EOF'
import re, sys, datetime
msg, ep, files = sys.argv[1], sys.argv[2], sys.argv[3:]
ts = []
for f in files:
    for line in open(f):
        if f'msg="{msg}"' in line and re.search(rf'\bepoch={ep}\b', line):
            ts.append(datetime.datetime.fromisoformat(re.search(r'time=(\S+)', line).group(1)).timestamp())
            break
print(f"{min(ts):.6f}" if ts else "missing")
EOF
}

mib() { python3 -c "print(f'{$1/1048576:.0f}')"; }
secs() { python3 -c "print(f'{$2-$1:.3f}')"; }
rate() { python3 -c "print(f'{$1/1048576/($3-$2):.0f}')"; }

for i in 1 2 3 4; do start_node "$i"; done
sleep 1
"$OVIS" cluster format --copies 3 -a "${L[1]}" >/dev/null
"$OVIS" vdi create rec "$SIZE" -a "${L[1]}" >/dev/null
URI="nbd://127.0.0.1:$NBD/rec"
head -c "$SIZE" /dev/urandom >"$TMP/data1"
nbdcopy "$TMP/data1" "$URI"
BYTES=$(stat -c %s "$TMP/data1")
wait_recovered 4

echo "# $(date -Is) ovis $(git -C "$(dirname "$0")/.." rev-parse --short HEAD); 4 nodes, copies 3, tmpfs, a VDI of $SIZE of random data; load $(cut -d' ' -f1-3 /proc/loadavg)"
t0=$(now); cp "$TMP/data1" "$TMP/copy"; sync; t1=$(now); rm -f "$TMP/copy"
echo "raw copy (cp on tmpfs): $(secs "$t0" "$t1") s, $(rate "$BYTES" "$t0" "$t1") MiB/s"

# 2. SIGKILL of node 4 while a QD1 write runs through node 1.
e0=$(epoch)
fio --name=stall --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=1 --size=64M \
	--time_based --runtime=6 --output-format=json >"$TMP/fio.json" 2>"$TMP/fio.err" &
FIO=$!
sleep 2
tk=$(now)
kill -9 "${PID[4]}"
wait "${PID[4]}" 2>/dev/null || true
if ! wait "$FIO"; then
	echo "fio failed across the kill:" >&2
	cat "$TMP/fio.err" "$TMP/fio.json" >&2
	exit 1
fi
wait_recovered 3
e1=$(epoch)
te=$(first_logged "membership epoch" $((e0 + 1)) 1 2 3)
read -r tr pulled < <(logged "recovery done" "$e1" 1 2 3)
maxlat=$(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]["write"]; print("%.0f ms, %.0f IOPS" % (j["clat_ns"]["max"]/1e6, j["iops"]))' "$TMP/fio.json")
echo "SIGKILL to new epoch: $(secs "$tk" "$te") s; client's longest write across it: $maxlat (QD1 4 KiB)"
echo "re-replication after losing 1 of 4: $(secs "$tk" "$tr") s from the kill, $(mib "$pulled") MiB pulled, $(rate "$pulled" "$tk" "$tr") MiB/s"

# 3. Rejoins: after the outage above (fio wrote on while node 4 was
# away), then again after an outage with no writes at all.
rejoin() { # WHAT
	local t0 t1 e pulled
	t0=$(now)
	start_node 4
	wait_recovered 4
	t1=$(now)
	e=$(epoch)
	read -r _ pulled < <(logged "recovery done" "$e" 1 2 3 4)
	echo "rejoin, $1: $(secs "$t0" "$t1") s from its start to every node recovered, $(mib "$pulled") MiB pulled"
}
rejoin "after the outage with writes"
kill -9 "${PID[4]}"
wait "${PID[4]}" 2>/dev/null || true
wait_recovered 3
rejoin "nothing changed"

# 4. Rejoin after the whole VDI was overwritten.
kill -9 "${PID[4]}"
wait "${PID[4]}" 2>/dev/null || true
wait_recovered 3
head -c "$SIZE" /dev/urandom >"$TMP/data2"
nbdcopy "$TMP/data2" "$URI"
t0=$(now)
start_node 4
wait_recovered 4
t1=$(now)
e3=$(epoch)
read -r _ pulled < <(logged "recovery done" "$e3" 4)
echo "rejoin after the VDI was overwritten: $(secs "$t0" "$t1") s, $(mib "$pulled") MiB pulled by node 4, $(rate "$pulled" "$t0" "$t1") MiB/s"
# 5. A VM's I/O while recovery runs: fio 4 KiB random reads at QD8
# through node 1, alone, then right after node 4 is killed (recovery
# unthrottled), then with recovery throttled to RATE on every node.
RATE=${RATE:-64M}
fio_read() { # SECONDS
	fio --name=vm --ioengine=nbd --uri="$URI" --rw=randread --bs=4k --iodepth=8 --size="$SIZE" \
		--time_based --runtime="$1" --output-format=json 2>/dev/null |
		python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))'
}
during() { # WHAT — kill node 4, measure, wait for recovery, bring it back
	local t0 t1 iops
	t0=$(now)
	kill -9 "${PID[4]}"
	wait "${PID[4]}" 2>/dev/null || true
	iops=$(fio_read 3)
	wait_recovered 3
	t1=$(now)
	echo "VM reads during recovery, $1: $iops IOPS (recovery took $(secs "$t0" "$t1") s)"
	start_node 4
	wait_recovered 4
}
echo "VM reads, no recovery: $(fio_read 3) IOPS"
during "unthrottled"
for i in 1 2 3; do "$OVIS" node recovery --max-rate "$RATE" -a "${L[$i]}" >/dev/null; done
during "throttled to $RATE/s per node"
for i in 1 2 3; do "$OVIS" node recovery --max-rate 0 -a "${L[$i]}" >/dev/null; done

nbdcopy "$URI" "$TMP/back"
cmp "$TMP/data2" "$TMP/back" && echo "the VDI reads back identical"
"$OVIS" cluster check -a "${L[1]}" | tail -1
