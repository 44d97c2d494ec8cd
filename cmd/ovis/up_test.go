package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestUp checks that ovis up creates a clean 20 GiB sparse qcow2 image
// once, keeps it on a second run, and says that it does not serve it yet.
func TestUp(t *testing.T) {
	dir := t.TempDir()
	r := ovis(t, dir, "up")
	if r.code != 0 {
		t.Fatalf("ovis up: exit %d\n%s", r.code, r.stderr)
	}
	disk := filepath.Join(dir, "ovis-data", "disk0.qcow2")
	if !strings.Contains(r.stdout, disk) || !strings.Contains(r.stdout, "created") {
		t.Errorf("ovis up printed %q, want the new disk's path", r.stdout)
	}
	if !strings.Contains(r.stdout, "ovis nbd") {
		t.Errorf("ovis up printed %q, want a word on NBD serving", r.stdout)
	}
	testutil.CheckImage(t, disk)
	if got := testutil.VirtualSize(t, disk); got != 20<<30 {
		t.Errorf("virtual size %d, want 20 GiB", got)
	}
	if got := testutil.AllocatedBytes(t, disk); got > 1<<20 {
		t.Errorf("a new disk takes %d bytes, want a sparse image", got)
	}
	r = ovis(t, dir, "up")
	if r.code != 0 || !strings.Contains(r.stdout, "exists") {
		t.Errorf("second ovis up: exit %d, %q", r.code, r.stdout)
	}
}
