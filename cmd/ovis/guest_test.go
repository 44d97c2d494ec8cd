package main

import (
	"context"
	"crypto/md5"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/ovis-storage/ovis/internal/guest"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// The guest tests boot a real Linux (Debian's cloud kernel, busybox and
// e2fsprogs in an initramfs that internal/guest builds) under QEMU, with
// its virtio disk on an NBD export of ovis, and read the nodes' metrics at
// each phase the guest's script reaches.

// cacheScript is the guest's script of TestGuestClusterCacheModes and
// TestGuestNBD. Under each state of the guest's write cache (the drive's
// default, turned off, turned on) it writes a 4 MiB pattern with
// O_DIRECT, reads it back, then fsyncs the disk; then it makes an ext4
// filesystem, writes files, syncs, unmounts and checks it.
const cacheScript = `
dd if=/dev/urandom of=/tmp/p bs=64k count=64 2>/dev/null
sum=$(md5sum < /tmp/p | cut -d' ' -f1)
ct() { tr ' ' _ < /sys/block/vda/cache_type; }
wr() {
	dd if=/tmp/p of=/dev/vda bs=64k seek=$1 oflag=direct 2>/dev/null || fail "dd at block $1"
	got=$(dd if=/dev/vda bs=64k skip=$1 count=64 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)
	[ "$got" = "$sum" ] || fail "read back at block $1: $got, wrote $sum"
}
phase default-set cache=$(ct)
wr 0
phase default-written
sync /dev/vda
phase default-synced
echo "write through" > /sys/block/vda/cache_type
phase off-set cache=$(ct)
wr 64
phase off-written
sync /dev/vda
phase off-synced
echo "write back" > /sys/block/vda/cache_type
phase on-set cache=$(ct)
wr 128
phase on-written
sync /dev/vda
phase on-synced
mkfs.ext4 -q -F /dev/vda
mount /dev/vda /mnt
i=0
while [ $i -lt 8 ]; do cp /tmp/p /mnt/f$i; i=$((i+1)); done
echo hello > /mnt/small
sync
phase fs-synced
umount /mnt
phase fs-unmounted
e2fsck -fn /dev/vda || fail "e2fsck -fn: exit $?"
phase fsck-clean
! dmesg | grep -iE 'I/O error|blk_update_request|critical (medium|target)' || fail "I/O errors in the kernel log"
`

// cachePhases are cacheScript's phases in order.
var cachePhases = []string{
	"default-set", "default-written", "default-synced",
	"off-set", "off-written", "off-synced",
	"on-set", "on-written", "on-synced",
	"fs-synced", "fs-unmounted", "fsck-clean",
}

// ioErrorRE matches the kernel's block I/O error lines.
var ioErrorRE = regexp.MustCompile(`(?i)I/O error|blk_update_request|critical (medium|target) error`)

// guestKernel finds the guest's kernel, failing the test without it.
func guestKernel(t *testing.T) guest.Kernel {
	t.Helper()
	k, err := guest.FindKernel()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// bootGuest starts a guest with script on drive. Its console goes to the
// test log when the test fails; QEMU is killed when the test ends.
func bootGuest(t *testing.T, drive, cache, script string, timeout time.Duration) *guest.VM {
	t.Helper()
	vm, err := guest.Start(context.Background(), guest.Config{
		Kernel: guestKernel(t), Script: script, Drive: drive, Cache: cache,
		Dir: t.TempDir(), Timeout: timeout, AnswerTimeout: timeout,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		vm.Close()
		if t.Failed() {
			t.Logf("QEMU: %s\nguest console (%s):\n%s", strings.Join(vm.Args(), " "), vm.Accel(), vm.Console())
		}
	})
	return vm
}

// writeCounts are what reached the nodes, summed over them: every replica
// counts.
type writeCounts struct{ writes, sync, flushes float64 }

func readCounts(t *testing.T, nodes []*clusterNode) writeCounts {
	// One scrape per node: counters read at different moments split a
	// write the guest's writeback sends across two phases, counted with
	// its sync flag in one and without in the other.
	m := nodeMetrics(t, nodes, `ovis_node_requests_total{op="write",status="ok"}`,
		`ovis_node_requests_total{op="write-zeroes",status="ok"}`, "ovis_node_sync_writes_total", "ovis_node_flushes_total")
	// The sync counter counts zero writes too (mkfs zeroes).
	return writeCounts{writes: m[0] + m[1], sync: m[2], flushes: m[3]}
}

func (c writeCounts) sub(o writeCounts) writeCounts {
	return writeCounts{c.writes - o.writes, c.sync - o.sync, c.flushes - o.flushes}
}

// plain are the writes without the sync flag.
func (c writeCounts) plain() float64 { return c.writes - c.sync }

// reached names what a phase sent the nodes: "plain", "FUA" and "flush"
// joined by "+", or "-" for nothing.
func (c writeCounts) reached() string {
	var s []string
	if c.plain() > 0 {
		s = append(s, "plain")
	}
	if c.sync > 0 {
		s = append(s, "FUA")
	}
	if c.flushes > 0 {
		s = append(s, "flush")
	}
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, "+")
}

// cacheRow is one phase of one boot in the cache-mode table.
type cacheRow struct {
	drive, node, guestCache, phase string
	got                            writeCounts
	want                           string // what reached() must say
}

// expectedReached is the table: with the guest's write cache on,
// O_DIRECT writes arrive plain and an fsync as flushes; off, they arrive
// as FUA writes and an fsync sends nothing. The gateway's --cache
// writethrough turns every plain write into a FUA one, and then has no
// flush to pass on: every write is durable when acknowledged.
func expectedReached(phase string, guestCacheOn, nodeForces bool) string {
	write := "plain"
	if !guestCacheOn || nodeForces {
		write = "FUA"
	}
	flush := guestCacheOn && !nodeForces
	switch {
	case strings.HasSuffix(phase, "-set"), phase == "fsck-clean":
		return "-" // switching the cache sends nothing; nor does e2fsck -n
	case strings.HasSuffix(phase, "-written"):
		return write
	case strings.HasSuffix(phase, "-synced") && phase != "fs-synced":
		if flush {
			return "flush"
		}
		return "-"
	default: // fs-synced, fs-unmounted: mkfs, the files, the journal
		if flush {
			return write + "+flush"
		}
		return write
	}
}

func printCacheTable(rows []cacheRow) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "QEMU drive cache\tnode --cache\tguest cache_type\tphase\twrites\tsync (FUA)\tflushes\treached\twant\t")
	for _, r := range rows {
		mark := ""
		if r.got.reached() != r.want {
			mark = "  <-- MISMATCH"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%.0f\t%.0f\t%.0f\t%s\t%s\t%s\n", r.drive, r.node, r.guestCache, r.phase, r.got.writes, r.got.sync, r.got.flushes, r.got.reached(), r.want, mark)
	}
	w.Flush()
	return b.String()
}

// runCachePhases walks vm through cacheScript, reading counts before each
// answer, and returns one row per phase. drive is the QEMU cache mode and
// nodeForces whether the gateway runs with --cache writethrough. The
// cache_type the guest reports is checked against wantSeen: the state
// after boot, after "write through" and after "write back".
func runCachePhases(t *testing.T, vm *guest.VM, nodes []*clusterNode, drive string, nodeForces bool, wantSeen [3]string) []cacheRow {
	t.Helper()
	ctx := context.Background()
	node := "writeback"
	if nodeForces {
		node = "writethrough"
	}
	var rows []cacheRow
	seen := ""
	prev := readCounts(t, nodes)
	for _, p := range cachePhases {
		e, err := vm.Phase(ctx, p)
		if err != nil {
			t.Fatalf("%v\ntable so far:\n%s", err, printCacheTable(rows))
		}
		now := readCounts(t, nodes)
		if c, ok := e.Args["cache"]; ok {
			seen = strings.ReplaceAll(c, "_", " ")
			i := map[string]int{"default-set": 0, "off-set": 1, "on-set": 2}[p]
			if seen != wantSeen[i] {
				t.Errorf("drive cache=%s, phase %s: the guest's cache_type is %q, want %q", drive, p, seen, wantSeen[i])
			}
		}
		rows = append(rows, cacheRow{
			drive: drive, node: node, guestCache: seen, phase: p, got: now.sub(prev),
			want: expectedReached(p, seen == "write back", nodeForces),
		})
		prev = now
		if err := vm.Continue(); err != nil {
			t.Fatal(err)
		}
	}
	if err := vm.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if ioErrorRE.MatchString(vm.Console()) {
		t.Errorf("drive cache=%s: I/O errors in the guest's kernel log", drive)
	}
	return rows
}

// TestGuestClusterCacheModes boots a guest against a VDI of a three-node
// cluster (copies=3) once per QEMU drive cache mode, and once through a
// gateway run with --cache writethrough, and checks what reached the
// nodes at every phase against the table (expectedReached).
//
// The guest can turn a cache=writethrough drive's write cache on: QEMU's
// virtio-blk offers VIRTIO_BLK_F_CONFIG_WCE (config-wce=on by default), so
// the guest sees "write through" and may write "write back", after which
// QEMU sends plain writes and flushes. Only the gateway's --cache
// writethrough keeps every write durable whatever the guest chooses.
func TestGuestClusterCacheModes(t *testing.T) {
	start := time.Now()
	nodes := startCluster(t, 3, "")
	n1 := nodes[0]
	// A fourth node whose gateway forces durability; with copies=3 of 4
	// the replicas land on any three.
	forced := startClusterNode(t, filepath.Join(t.TempDir(), "n4"), n1.etcd, "--cache", "writethrough")
	all := append(append([]*clusterNode(nil), nodes...), forced)
	waitUp(t, n1, 4)
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	const wb, wt = "write back", "write through"
	cases := []struct {
		drive    string
		gateway  *clusterNode
		forces   bool
		wantSeen [3]string // cache_type after boot, after "write through", after "write back"
	}{
		{"writeback", n1, false, [3]string{wb, wt, wb}},
		{"writethrough", n1, false, [3]string{wt, wt, wb}},
		{"none", n1, false, [3]string{wb, wt, wb}},
		{"directsync", n1, false, [3]string{wt, wt, wb}},
		{"writeback", forced, true, [3]string{wb, wt, wb}},
	}
	var rows []cacheRow
	var boots []string
	for i, c := range cases {
		name := fmt.Sprintf("guest%d", i)
		n1.mustAdmin(t, "vdi", "create", name, "64M")
		vm := bootGuest(t, "nbd://"+c.gateway.nbd+"/"+name, c.drive, cacheScript, 3*time.Minute)
		rows = append(rows, runCachePhases(t, vm, all, c.drive, c.forces, c.wantSeen)...)
		boots = append(boots, fmt.Sprintf("%s/%v", c.drive, vm.Elapsed().Round(100*time.Millisecond)))
		if t.Failed() {
			break
		}
	}
	table := printCacheTable(rows)
	for _, r := range rows {
		if r.got.reached() != r.want {
			t.Errorf("drive cache=%s, node --cache %s, guest %q, phase %s: %s reached the nodes, want %s", r.drive, r.node, r.guestCache, r.phase, r.got.reached(), r.want)
		}
		// Exact counts where the guest's requests are known: 64 writes of
		// 64 KiB, each reaching the 3 replicas once; each -written phase
		// fills one 4 MiB object, so the fsync after it flushes that
		// object's 3 replicas (the gateway flushes the nodes written to
		// since its last flush).
		if strings.HasSuffix(r.phase, "-written") && (r.got.writes != 3*64 || r.got.flushes != 0) {
			t.Errorf("drive cache=%s, node --cache %s, phase %s: %v writes and %v flushes at the nodes for 64 guest writes, want %d and 0", r.drive, r.node, r.phase, r.got.writes, r.got.flushes, 3*64)
		}
		if r.want == "flush" && r.got.flushes != 3 {
			t.Errorf("drive cache=%s, phase %s: %v flushes at the nodes for one guest fsync, want 3", r.drive, r.phase, r.got.flushes)
		}
		if (strings.HasSuffix(r.phase, "-synced") && r.phase != "fs-synced" || r.phase == "fsck-clean") && r.got.writes != 0 {
			t.Errorf("drive cache=%s, phase %s: %v writes from an fsync of a disk written only with O_DIRECT, or from e2fsck -n", r.drive, r.phase, r.got.writes)
		}
	}
	t.Logf("accel %s; boots %s; whole test %v\n%s", guest.DefaultAccel(guestKernel(t)), strings.Join(boots, " "), time.Since(start).Round(100*time.Millisecond), table)
}

// TestGuestNBD runs cacheScript against `ovis nbd` serving a qcow2 file,
// with the drive in writeback and in writethrough; the guest's checks
// (read-back, e2fsck) must pass and qemu-img check must find the image
// clean once the server has stopped.
func TestGuestNBD(t *testing.T) {
	for _, cache := range []string{"writeback", "writethrough"} {
		t.Run(cache, func(t *testing.T) {
			dir := t.TempDir()
			img := filepath.Join(dir, "disk.qcow2")
			if r := qemuImg(t, dir, "create", "-f", "qcow2", img, "64M"); r.code != 0 {
				t.Fatal(r.stderr)
			}
			s := startNBD(t, nbdRun{tcp: true, export: "disk", args: []string{"-f", "qcow2", img}})
			vm := bootGuest(t, s.uri, cache, cacheScript, 3*time.Minute)
			ctx := context.Background()
			for _, p := range cachePhases {
				if _, err := vm.Phase(ctx, p); err != nil {
					t.Fatalf("%v\nserver stderr:\n%s", err, s.stderr)
				}
				if err := vm.Continue(); err != nil {
					t.Fatal(err)
				}
			}
			if err := vm.Wait(ctx); err != nil {
				t.Fatalf("%v\nserver stderr:\n%s", err, s.stderr)
			}
			if ioErrorRE.MatchString(vm.Console()) {
				t.Errorf("I/O errors in the guest's kernel log")
			}
			s.stop(syscall.SIGTERM)
			if r := qemuImg(t, dir, "check", img); r.code != 0 {
				t.Errorf("qemu-img check after the guest: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			t.Logf("accel %s, cache=%s: guest %v", vm.Accel(), cache, vm.Elapsed().Round(100*time.Millisecond))
		})
	}
}

// killScript writes 40 chunks of 256 KiB with the guest's write cache
// off, each twice: raw at 32 MiB on, and as a file in an ext4 filesystem
// on the first 32 MiB (O_DIRECT and fsync). It says WROTE after each and
// paces itself so that the test can kill a node in the middle. Then it
// reads every chunk back both ways, unmounts and runs e2fsck.
const killScript = `
echo "write through" > /sys/block/vda/cache_type
[ "$(cat /sys/block/vda/cache_type)" = "write through" ] || fail "cache_type: $(cat /sys/block/vda/cache_type)"
dd if=/dev/urandom of=/tmp/p bs=256k count=40 2>/dev/null
mkfs.ext4 -q -F /dev/vda 32M
mount /dev/vda /mnt
phase ready raw=$(md5sum < /tmp/p | cut -d' ' -f1)
i=0
while [ $i -lt 40 ]; do
	dd if=/tmp/p of=/dev/vda bs=256k skip=$i seek=$((128+i)) count=1 oflag=direct 2>/dev/null || fail "raw write $i"
	dd if=/tmp/p of=/mnt/f$i bs=256k skip=$i count=1 oflag=direct conv=fsync 2>/dev/null || fail "file write $i"
	say WROTE n=$i
	sleep 0.2
	i=$((i+1))
done
phase written
sync
echo 3 > /proc/sys/vm/drop_caches
i=0
while [ $i -lt 40 ]; do
	a=$(dd if=/tmp/p bs=256k skip=$i count=1 2>/dev/null | md5sum)
	b=$(dd if=/dev/vda bs=256k skip=$((128+i)) count=1 iflag=direct 2>/dev/null | md5sum)
	[ "$a" = "$b" ] || fail "raw chunk $i reads back $b, wrote $a"
	c=$(md5sum < /mnt/f$i)
	[ "$a" = "$c" ] || fail "file f$i reads back $c, wrote $a"
	i=$((i+1))
done
umount /mnt
e2fsck -fn /dev/vda || fail "e2fsck -fn: exit $?"
! dmesg | grep -iE 'I/O error|blk_update_request|critical (medium|target)' || fail "I/O errors in the kernel log"
`

// TestGuestClusterNodeKill kills a node that is not the guest's gateway
// with SIGKILL while the guest writes with its cache off. The guest must
// see no I/O error, every chunk must read back in the guest, and, through
// another node afterwards, the raw chunks must match and the filesystem
// must be clean.
func TestGuestClusterNodeKill(t *testing.T) {
	start := time.Now()
	nodes := startCluster(t, 3, "")
	gw, other, victim := nodes[0], nodes[1], nodes[2]
	gw.mustAdmin(t, "cluster", "format", "--copies", "3")
	gw.mustAdmin(t, "vdi", "create", "kill", "64M")
	vm := bootGuest(t, "nbd://"+gw.nbd+"/kill", "writeback", killScript, 3*time.Minute)
	ctx := context.Background()
	ready, err := vm.Phase(ctx, "ready")
	if err != nil {
		t.Fatal(err)
	}
	if err := vm.Continue(); err != nil {
		t.Fatal(err)
	}
	var (
		killed       time.Time
		last         time.Time
		maxGap       time.Duration
		afterKill    int
		wroteBefore  = -1
		killAfterOne = 5
	)
	for {
		e, err := vm.Next(ctx)
		if err != nil {
			t.Fatalf("%v\ngateway stderr:\n%s", err, gw.stderr)
		}
		if e.Kind == "FAIL" {
			t.Fatalf("guest failed: %s\ngateway stderr:\n%s", e.Name, gw.stderr)
		}
		if e.Kind == "PHASE" && e.Name == "written" {
			break
		}
		if e.Kind != "WROTE" {
			continue
		}
		if !last.IsZero() && e.Time.Sub(last) > maxGap {
			maxGap = e.Time.Sub(last)
		}
		last = e.Time
		if !killed.IsZero() {
			afterKill++
		}
		if killed.IsZero() && e.Args["n"] == fmt.Sprint(killAfterOne) {
			wroteBefore = killAfterOne
			victim.kill(syscall.SIGKILL)
			killed = time.Now()
		}
	}
	if killed.IsZero() || afterKill == 0 {
		t.Fatalf("the node was not killed in the middle of the writes (killed %v, %d writes after)", !killed.IsZero(), afterKill)
	}
	if err := vm.Continue(); err != nil {
		t.Fatal(err)
	}
	if err := vm.Wait(ctx); err != nil {
		t.Fatalf("%v\ngateway stderr:\n%s", err, gw.stderr)
	}
	if ioErrorRE.MatchString(vm.Console()) {
		t.Errorf("I/O errors in the guest's kernel log")
	}
	// Through another node: the raw chunks, and the filesystem.
	dir := t.TempDir()
	raw := filepath.Join(dir, "vdi.raw")
	if r := qemuImg(t, dir, "convert", "-f", "raw", "-O", "raw", "nbd://"+other.nbd+"/kill", raw); r.code != 0 {
		t.Fatalf("qemu-img convert through the surviving node: %s", r.stderr)
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprintf("%x", md5.Sum(b[32<<20:32<<20+40*256<<10])); got != ready.Args["raw"] {
		t.Errorf("the raw chunks read through another node: md5 %s, the guest wrote %s", got, ready.Args["raw"])
	}
	if err := os.Truncate(raw, 32<<20); err != nil {
		t.Fatal(err)
	}
	if o, e, c := testutil.RunIn(t, dir, "e2fsck", "-fn", raw); c != 0 {
		t.Errorf("e2fsck -fn of the filesystem read through another node: exit %d\n%s%s", c, o, e)
	}
	t.Logf("accel %s: killed %s after write %d; %d writes after the kill; longest gap between writes %v; guest %v, whole test %v",
		vm.Accel(), victim.addr, wroteBefore, afterKill, maxGap.Round(time.Millisecond), vm.Elapsed().Round(100*time.Millisecond), time.Since(start).Round(100*time.Millisecond))
}
