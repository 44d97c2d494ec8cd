package guest

import (
	"fmt"
	"strings"
)

// initScript is the guest's /init: it mounts the pseudo filesystems,
// opens the control port (ttyS1, the second serial port) raw, loads the
// disk's modules, waits for /dev/vda, runs /script under set -e and powers
// off. The script has three functions:
//
//   - phase NAME [KEY=VALUE...]: tells the test a phase boundary was
//     reached and waits (up to the answer timeout) for it to answer;
//   - say KIND ARGS...: one line to the test that needs no answer;
//   - fail MESSAGE: reports a failure and powers off.
//
// Every line to the test is also printed on the console, so that the
// console log reads as the whole story.
func initScript(modules []string, answerTimeoutSec int) string {
	return fmt.Sprintf(`#!/bin/sh
/bin/busybox --install -s /bin 2>/dev/null
export PATH=/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
off() { sync; poweroff -f; sleep 5; echo o > /proc/sysrq-trigger; sleep 60; }
stty -F /dev/ttyS1 raw -echo || { echo "OVIS FAIL no control port ttyS1"; off; }
exec 3<>/dev/ttyS1
T=%d
say() { echo "OVIS $*"; echo "OVIS $*" >&3; }
fail() { say FAIL "$*"; off; }
phase() {
	say PHASE "$@"
	ans=
	read -r -t "$T" ans <&3 || fail "phase $1: no answer in $T s"
	[ "$ans" = go ] || fail "phase $1: answer \"$ans\", want go"
}
for m in %s; do
	insmod "$m" || fail "insmod $m"
done
i=0
while [ ! -b /dev/vda ]; do
	i=$((i+1))
	[ $i -lt 300 ] || fail "no /dev/vda after 30 s"
	sleep 0.1
done
say BOOTED
( set -e; . /script ) || fail "script exited with $?"
say DONE
off
`, answerTimeoutSec, strings.Join(modules, " "))
}
