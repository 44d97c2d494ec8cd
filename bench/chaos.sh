#!/usr/bin/env bash
# Chaos under verified load (issue 18): random kills, clean stops,
# restarts, joins, leaves and partitions of `ovis node`s, each in its own
# network namespace with Debian's etcd in the root one, for N minutes,
# while several clients write and verify (fio, crc32c) through them.
# Every event and check is printed as it happens, then a summary; the
# exit code is non-zero if anything failed. Needs root (namespaces).
#
# Usage: bench/chaos.sh [-minutes N] [-seed S] [other flags of bench/chaos]
#   -sabotage junk|stale  self-test: the run must fail (docs/recovery.md)
#   OUT=file  also writes the output there
#   KEEP=1    keeps the data directory and the logs (printed at the start)
GIVEN_BENCH_DIR=${BENCH_DIR:-}
source "$(dirname "$0")/lib.sh"
need_tools
command -v etcd >/dev/null || { echo "etcd missing: run scripts/test.sh (Debian's etcd-server)" >&2; exit 1; }
build_ovis
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CHAOS=$(mktemp -d)/chaos
(cd "$ROOT" && go build -o "$CHAOS" ./bench/chaos)
DIR=$(mktemp -d /dev/shm/ovis-chaos.XXXXXX)
cleanup() {
	[ -n "${KEEP:-}" ] && { echo "kept $DIR" >&2; return; }
	rm -rf "$DIR" "$(dirname "$CHAOS")"
	[ -n "$GIVEN_BENCH_DIR" ] || rm -rf "$BENCH_DIR"
}
trap cleanup EXIT
echo "# $(date -Is) ovis $(git -C "$ROOT" rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "${OUT:-}" ]; then
	"$CHAOS" -ovis "$OVIS" -dir "$DIR" "$@" | tee "$OUT"
	exit "${PIPESTATUS[0]}"
fi
"$CHAOS" -ovis "$OVIS" -dir "$DIR" "$@"
