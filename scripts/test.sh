#!/usr/bin/env bash
# Installs what the tests need on a Debian machine, then vets and tests
# every package. QEMU's tools are the oracle the tests compare with, so
# they are installed rather than skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

# iproute2's ip: internal/netns (network namespaces for partitions; root).
packages=(qemu-utils fio libnbd-bin nbdkit qemu-system-x86 etcd-server strace cpio iproute2)
tools=(qemu-img fio nbdinfo nbdkit qemu-system-x86_64 etcd strace cpio ip)

missing=()
for i in "${!tools[@]}"; do
	command -v "${tools[$i]}" >/dev/null 2>&1 || missing+=("${packages[$i]}")
done
# qemu-system-x86 only recommends its firmware; without it no VM starts.
[ -e /usr/share/seabios/bios-256k.bin ] || missing+=(seabios)
[ -d /usr/lib/ipxe/qemu ] || missing+=(ipxe-qemu)
# The guest tests (internal/guest, cmd/ovis/guest_test.go) boot Debian's
# cloud kernel with busybox and the host's e2fsprogs in an initramfs.
compgen -G '/boot/vmlinuz-*-cloud-amd64' >/dev/null || missing+=(linux-image-cloud-amd64)
# The static build: a dynamic /bin/busybox (Debian's busybox) would need
# libraries the initramfs does not carry.
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || missing+=(busybox-static)
{ command -v mke2fs || [ -x /sbin/mke2fs ]; } >/dev/null 2>&1 || missing+=(e2fsprogs)
if ((${#missing[@]})); then
	sudo=()
	if [ "$(id -u)" -ne 0 ]; then
		sudo=(sudo)
	fi
	echo "installing ${missing[*]}"
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! command -v go >/dev/null 2>&1; then
	export PATH="$PATH:/usr/local/go/bin"
fi
go version

go vet ./...
# cmd/ovis's cluster and guest tests (real node processes, QEMU guests)
# mostly wait on leases, restarts and timers, one test at a time, while
# the rest of the suite (qemu-img comparisons, the engines' tests) is
# CPU-bound: they run in go tests of their own next to it, in two shards
# of about equal length (the guests, the history runs and the etcd
# trouble test, then the rest; a new test lands in the second). So does
# the rest of cmd/ovis, the longest package by far: in ./... it waited
# for a -p slot behind the packages before it (cluster/...). qcow2 comes
# next in length: its race-detector half starts at once too, and its
# single-goroutine tests (below) run without the race detector, where it
# can find nothing, after the other packages. Their output comes first,
# then the background tests'. The timeout only catches hangs: it leaves
# room for a slow shared host.
cluster='^Test(Cluster|Guest)'
shard='^(TestGuest.*|TestClusterHistory.*|TestClusterEtcdTrouble)$'
# qcow2's tests that run in one goroutine against the engine (and
# qemu-img): the crash harness, the model, the smoke and amend tests and
# the tables that qemu-img reads or checks (some run their cases as
# parallel subtests, each on an image of its own). The
# engine starts goroutines only when a caller waits for its gate; its
# concurrent tests (TestModelConcurrent, TestCompressConcurrent, the
# cache, cancel and write-run tests, TestWriteInteropConcurrent, ...)
# keep the race detector. TestWriteInterop and TestWriteInteropQemuImages
# run their one writer in the test's goroutine (runWorkers).
qseq='^(TestCrashConsistency|TestEngineSmoke|TestAmend|TestAmendDowngradeSnapshots|TestSnapshotCycle|TestCheckAgainstQemu|TestMakeEmptyWholeMatchesQemu|TestCrashConsistencyBigWrites|TestCrashHarnessCatchesBrokenOrdering|TestMakeEmptyWholeCrash|TestModel|TestBitmapModel|TestResize|TestReadNoWait|TestQEMUReadsOurClusters|TestQEMUCompressedClusters|TestCompressRoundTrip|TestQEMUSnapshotTable|TestParseSnapshotTableErrors|TestLazyRefcountsDirtyRebuild|TestOverlapAllocationLikeQemu|TestMapMatchesQemu|TestMakeEmpty|TestWriteInterop|TestWriteInteropQemuImages|TestCheckContextStopsSafely|TestAmendShrinkWithSnapshot|TestMakeEmptyWholeKeepsWorking|TestAmendRefcountNarrowing|TestAmendUpgradeSnapshotTable)$'
bin=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$bin" "$logs"' EXIT
# Compiled once first, so that the go tests do not compile them side by
# side: the test binary, and the ovis binaries (plain and -race) that
# cmd/ovis's TestMain takes from OVIS_TEST_BIN and OVIS_TEST_RACE_BIN
# (it builds its own pair when they are not set).
go test -race -c -o /dev/null ./cmd/ovis
go build -o "$bin/ovis" ./cmd/ovis
mkdir "$bin/race"
go build -race -o "$bin/race/ovis" ./cmd/ovis
export OVIS_TEST_BIN="$bin/ovis" OVIS_TEST_RACE_BIN="$bin/race/ovis"
declare -A pids
go test -race -timeout 45m -run "$cluster" -skip "$shard" ./cmd/ovis >"$logs/cluster" 2>&1 &
pids[cluster]=$!
go test -race -timeout 45m -run "$shard" ./cmd/ovis >"$logs/shard" 2>&1 &
pids[shard]=$!
go test -race -timeout 45m -skip "$cluster" ./cmd/ovis >"$logs/ovis" 2>&1 &
pids[ovis]=$!
go test -race -timeout 45m -skip "$qseq" ./qcow2 >"$logs/qcow2" 2>&1 &
pids[qcow2]=$!
# The img verbs' tests against qemu-img (cmd/ovis/internal/img: the
# engine's repros that run the verbs in process, moved out of cmd/ovis's
# subprocess tests) are the next longest after qcow2, mostly qemu-img
# runs: they start at once too, so that they do not end the run alone
# after the other packages. Without the race detector, as when they ran
# the plain ovis binary as a subprocess: the verbs' concurrency is the
# engine's and convert's, whose own tests keep it.
go test -timeout 45m ./cmd/ovis/internal/img >"$logs/img" 2>&1 &
pids[img]=$!
# The other packages run whole: the cluster pattern is cmd/ovis's alone
# (internal/guest has TestGuest tests of its own).
mapfile -t others < <(go list ./... | grep -vx -e 'github.com/ovis-storage/ovis/cmd/ovis' -e 'github.com/ovis-storage/ovis/qcow2' -e 'github.com/ovis-storage/ovis/cmd/ovis/internal/img')
rc=0
go test -race -timeout 45m "${others[@]}" || rc=$?
go test -timeout 45m -run "$qseq" ./qcow2 || rc=$?
for name in qcow2 img ovis shard cluster; do
	wait "${pids[$name]}" || rc=1
	case $name in
	qcow2) echo "--- qcow2 with the race detector, all but its single-goroutine tests:" ;;
	img) echo "--- cmd/ovis/internal/img:" ;;
	ovis) echo "--- cmd/ovis, all but ${cluster}:" ;;
	shard) echo "--- cmd/ovis, ${shard}:" ;;
	cluster) echo "--- cmd/ovis, the rest of ${cluster}:" ;;
	esac
	cat "$logs/$name"
done
exit "$rc"
