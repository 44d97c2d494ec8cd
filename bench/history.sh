#!/usr/bin/env bash
# The history checker (issue 26) for a long run: cmd/ovis's
# TestClusterHistory with real `ovis node`s on Debian's etcd, clients on
# every gateway, the nemesis (kills, stops, every holder of some objects
# down at once with restarts slower than the lease, lock breaks), then
# internal/histcheck on the whole history. Prints the counts (ops,
# acknowledged writes, reads, indeterminate writes, read errors, nemesis
# events by kind, violations by kind) and keeps the report in
# bench/results/. The exit code is non-zero on any violation.
#
# Usage: bench/history.sh [-minutes N] [-seed S] [-sabotage stale|torn|junk[,...]] [-race] [-disjoint]
#   -sabotage  self-test: damages acknowledged blocks in every copy before
#              the final reads; the run must then fail (docs/recovery.md)
#   -race      builds the nodes and the test with the race detector (slower)
#   -disjoint  each writer writes its own blocks: no two writes to one
#              block in flight at once (recovery alone)
#   OUT=file   the report (default bench/results/history-DATE-COMMIT-Nmin.txt)
set -euo pipefail
export PATH=$PATH:/usr/local/go/bin
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
minutes=30 seed=$(date +%s) sabotage="" race="" disjoint=""
while (($#)); do
	case $1 in
	-minutes) minutes=$2; shift 2 ;;
	-seed) seed=$2; shift 2 ;;
	-sabotage) sabotage=$2; shift 2 ;;
	-race) race=-race; shift ;;
	-disjoint) disjoint=1; shift ;;
	*) echo "usage: $0 [-minutes N] [-seed S] [-sabotage stale|torn|junk] [-race] [-disjoint]" >&2; exit 2 ;;
	esac
done
command -v etcd >/dev/null || { echo "etcd missing: run scripts/test.sh (Debian's etcd-server)" >&2; exit 1; }
command -v qemu-img >/dev/null || { echo "qemu-img missing: run scripts/test.sh (qemu-utils)" >&2; exit 1; }
commit=$(git -C "$ROOT" rev-parse --short HEAD)
suffix=""
[ -n "$sabotage" ] && suffix="-sabotage-${sabotage//,/-}"
[ -n "$disjoint" ] && suffix="$suffix-disjoint"
OUT=${OUT:-$ROOT/bench/results/history-$(date +%F)-$commit-${minutes}min$suffix.txt}
LOG=$(mktemp /tmp/ovis-history.XXXXXX.log)
echo "# $(date -Is) ovis $commit; seed $seed; ${minutes} min; sabotage ${sabotage:-none}; disjoint writers ${disjoint:-no}; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# report: $OUT; test log: $LOG"
set +e
(cd "$ROOT" && OVIS_HIST_DURATION=${minutes}m OVIS_HIST_SEED=$seed OVIS_HIST_SABOTAGE=$sabotage OVIS_HIST_OUT=$OUT OVIS_HIST_DISJOINT=$disjoint \
	go test $race ./cmd/ovis -run '^TestClusterHistory$' -count=1 -v -timeout $((minutes + 20))m >"$LOG" 2>&1)
rc=$?
set -e
grep -E '^\s+history_test.go:[0-9]+: run:' "$LOG" | sed 's/^ *history_test.go:[0-9]*: //' || true
if [ -s "$OUT" ]; then
	# The report's head: the counts and the violations by kind.
	sed -n '1,/^violations/p' "$OUT"
	echo "exit $rc (ovis $commit, seed $seed)" >>"$OUT"
else
	echo "no report: the test did not get to its check; its log:" >&2
	tail -60 "$LOG" >&2
fi
echo "exit $rc"
exit $rc
