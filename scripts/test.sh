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
# The tests run with -parallel 3 on 2 cores: cmd/ovis's cluster tests
# (one at a time) mostly wait on leases and timers, and run next to the
# CPU-bound img comparisons (main_test.go's serialCluster). The timeout
# only catches hangs: it leaves room for a slow shared host.
go test -race -parallel 3 -timeout 45m ./...
