#!/usr/bin/env bash
# cmd/ovis's larger tables of qemu-img comparisons, every row. The suite
# (scripts/test.sh) runs a Latin-square sample of each (main_test.go's
# sampled: every pair of dimension values still runs together); this
# runs the rest, OVIS_FULL=1, under the race detector as CI does, and
# keeps the summary in bench/results/.
#
# Usage: bench/full-tables.sh
#   OUT=file   the summary (default bench/results/full-tables-DATE-COMMIT.txt)
set -euo pipefail
export PATH=$PATH:/usr/local/go/bin
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
commit=$(git rev-parse --short HEAD)
out=${OUT:-bench/results/full-tables-$(date +%F)-$commit.txt}
tables='^(TestReproResizeGrowZeroes|TestRebaseKeepsGuestData|TestCommitKeepsGuestData|TestCheckRepairMatchesQemu)$'
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
set +e
OVIS_FULL=1 go test -race -count=1 -v -timeout 60m -run "$tables" ./cmd/ovis >"$log" 2>&1
code=$?
set -e
{
	echo "bench/full-tables.sh at $commit, $(date -u +%FT%TZ), $(nproc) cores, $(($(date +%s) - start)) s, exit $code"
	for t in TestReproResizeGrowZeroes TestRebaseKeepsGuestData TestCommitKeepsGuestData TestCheckRepairMatchesQemu; do
		printf '%-28s %4d passed %3d failed %3d skipped\n' "$t" \
			"$(grep -c "^    --- PASS: $t/" "$log")" "$(grep -c "^    --- FAIL: $t/" "$log")" "$(grep -c "^    --- SKIP: $t/" "$log")"
	done
	grep -E '^\s+--- FAIL|^FAIL|panic:' "$log" || true
} | tee "$out"
exit $code
