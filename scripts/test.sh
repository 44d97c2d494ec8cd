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
# CPU-bound: they run in a go test of their own next to it. So does the
# rest of cmd/ovis, the longest package by far: in ./... it waited for
# a -p slot behind the packages before it (cluster/...). The other
# packages' output comes first, then cmd/ovis's. The timeout only
# catches hangs: it leaves room for a slow shared host.
cluster='^Test(Cluster|Guest)'
# Compiled once first, so that the three do not compile it side by side:
# the test binary, and the ovis binaries (plain and -race) that
# cmd/ovis's TestMain builds in each of its two go tests, which then
# only link.
go test -race -c -o /dev/null ./cmd/ovis
go build -o /dev/null ./cmd/ovis
go build -race -o /dev/null ./cmd/ovis
clog=$(mktemp)
olog=$(mktemp)
trap 'rm -f "$clog" "$olog"' EXIT
go test -race -timeout 45m -run "$cluster" ./cmd/ovis >"$clog" 2>&1 &
cpid=$!
go test -race -timeout 45m -skip "$cluster" ./cmd/ovis >"$olog" 2>&1 &
opid=$!
mapfile -t others < <(go list ./... | grep -vx 'github.com/ovis-storage/ovis/cmd/ovis')
rc=0
go test -race -timeout 45m -skip "$cluster" "${others[@]}" || rc=$?
orc=0
wait "$opid" || orc=$?
crc=0
wait "$cpid" || crc=$?
echo "--- cmd/ovis, all but ${cluster}:"
cat "$olog"
echo "--- cmd/ovis, ${cluster}:"
cat "$clog"
if ((rc != 0 || orc != 0 || crc != 0)); then
	exit 1
fi
