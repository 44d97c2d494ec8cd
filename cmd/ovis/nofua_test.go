package main

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"testing"
)

// TestClusterNBDNoFUA checks the diagnostic `ovis node --nbd-no-fua` that
// bench/guest-dd.sh's emulated mode relies on: the same writethrough
// client (qemu-img bench -t writethrough) sends FUA writes through a
// gateway that advertises FUA, and write + flush through one that does
// not. nbdinfo reads the advertised flag; the nodes' metrics, summed over
// every replica, count what arrived.
func TestClusterNBDNoFUA(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1 := nodes[0]
	noFUA := startClusterNode(t, filepath.Join(t.TempDir(), "n4"), n1.etcd, "--nbd-no-fua")
	all := append(append([]*clusterNode(nil), nodes...), noFUA)
	waitUp(t, n1, 4)
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	const writes, copies = 20, 3
	cases := []struct {
		name                string
		gateway             *clusterNode
		canFUA              bool
		wantSync, wantFlush float64 // at the nodes, for `writes` writethrough writes
	}{
		// One sync request per replica per write, and no flush.
		{"fua", n1, true, writes * copies, 0},
		// Plain writes, each followed by a flush that the gateway sends to
		// the three replicas it wrote.
		{"no-fua", noFUA, false, 0, writes * copies},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			vdi := "nofua-" + c.name
			n1.mustAdmin(t, "vdi", "create", vdi, "64M")
			uri := "nbd://" + c.gateway.nbd + "/" + vdi
			can := runTool(t, "nbdinfo", "--json", uri)
			var info struct {
				Exports []struct {
					CanFUA bool `json:"can_fua"`
				} `json:"exports"`
			}
			if err := json.Unmarshal([]byte(can), &info); err != nil || len(info.Exports) != 1 {
				t.Fatalf("nbdinfo --json %s: %v\n%s", uri, err, can)
			}
			if info.Exports[0].CanFUA != c.canFUA {
				t.Errorf("nbdinfo: can_fua %v, want %v", info.Exports[0].CanFUA, c.canFUA)
			}
			before := readCounts(t, all)
			if r := qemuImg(t, "", "bench", "-w", "-t", "writethrough", "-c", fmt.Sprint(writes), "-d", "1", "-s", "64k", "-f", "raw", uri); r.code != 0 {
				t.Fatalf("qemu-img bench: %s", r.stderr)
			}
			got := readCounts(t, all).sub(before)
			if got.writes != writes*copies || got.sync != c.wantSync || got.flushes != c.wantFlush {
				t.Errorf("%d writethrough writes through %s: the nodes got %v writes, %v with sync, %v flushes; want %d, %v, %v",
					writes, c.name, got.writes, got.sync, got.flushes, writes*copies, c.wantSync, c.wantFlush)
			}
		})
	}
}
