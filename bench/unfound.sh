#!/usr/bin/env bash
# Issue 26's reproduction, many times over, with stagger delays from 2 to
# 30 s: TestClusterAllHoldersAway (4 nodes on Debian's etcd, copies 3,
# lease 2 s, 64 FUA-written blocks in 64 objects; every node SIGKILLed and
# back one at a time STAGGER apart, then three of four) run ROUNDS times
# per stagger. Prints one line per stagger: runs, rounds passed, the
# unfound objects seen and how long the reads waited; exits 1 on any
# failure. Usage: bench/unfound.sh [ROUNDS] [STAGGER...]
# (default 3 rounds of 2s 7s 15s 30s).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
staggers=("$@")
((${#staggers[@]})) || staggers=(2s 7s 15s 30s)
export PATH="$PATH:/usr/local/go/bin"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
printf '%-8s %-7s %-8s %-22s %s\n' STAGGER ROUNDS RESULT UNFOUND "READS WAITED"
for s in "${staggers[@]}"; do
	log="$out/$s.log"
	if OVIS_UNFOUND_STAGGER=$s OVIS_UNFOUND_ROUNDS=$rounds go test ./cmd/ovis -run '^TestClusterAllHoldersAway$' -count=1 -v -timeout 2h >"$log" 2>&1; then
		res=pass
	else
		res=FAIL
		fail=1
		cp "$log" "bench/results/unfound-$s-failed.log"
	fi
	unfound=$(grep -o '[0-9]* objects unfound' "$log" | awk '{print $1}' | paste -sd, -)
	waited=$(grep -o 'during the outage: all intact, in [0-9.]*s' "$log" | awk '{print $NF}' | paste -sd, -)
	printf '%-8s %-7s %-8s %-22s %s\n' "$s" "$rounds" "$res" "${unfound:--}" "${waited:--}"
done
exit $fail
