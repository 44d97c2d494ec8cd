package main

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

type mapRun struct {
	Start  int64 `json:"start"`
	Length int64 `json:"length"`
	Zero   bool  `json:"zero"`
	Data   bool  `json:"data"`
}

// mergeRuns joins neighbours with the same zero/data flags: over NBD
// depth and offsets are not visible, so only these are compared.
func mergeRuns(t *testing.T, js string) []mapRun {
	t.Helper()
	var in []mapRun
	if err := json.Unmarshal([]byte(js), &in); err != nil {
		t.Fatalf("%v\n%s", err, js)
	}
	var out []mapRun
	for _, r := range in {
		if k := len(out) - 1; k >= 0 && out[k].Zero == r.Zero && out[k].Data == r.Data {
			out[k].Length += r.Length
			continue
		}
		out = append(out, r)
	}
	return out
}

// TestNBDMapMatchesLocalMap: `qemu-img map` over nbd:// served by ovis nbd
// shows the same zero/data runs as `ovis img map` of the image file.
func TestNBDMapMatchesLocalMap(t *testing.T) {
	dir := shortTempDir(t)
	img := filepath.Join(dir, "m.qcow2")
	runTool(t, "qemu-img", "create", "-f", "qcow2", img, "16M")
	runTool(t, "qemu-io", "-c", "write -P 1 0 1M", "-c", "write -z 2M 128k", "-c", "write -P 2 4M 64k",
		"-c", "write -c -P 3 8M 64k", "-c", "discard 512k 64k", img)
	local := mustOvisImg(t, dir, "map", "--output=json", img).stdout
	s := startNBD(t, nbdRun{args: []string{"-t", "-r", "-f", "qcow2", img}})
	remote := runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", s.uri)
	s.stop(15)
	l, r := mergeRuns(t, local), mergeRuns(t, remote)
	lj, _ := json.Marshal(l)
	rj, _ := json.Marshal(r)
	if string(lj) != string(rj) {
		t.Fatalf("map differs\novis img map: %s\nqemu-img map over NBD: %s", lj, rj)
	}
	if len(l) < 4 {
		t.Fatalf("expected several runs, got %s", lj)
	}
}

// sameNBDMap fails the test unless `qemu-img map` over ovis nbd serving
// the qcow2 image at p read-only prints what it prints over qemu-nbd.
func sameNBDMap(t *testing.T, p string) {
	t.Helper()
	sock := filepath.Join(shortTempDir(t), "q.sock")
	stop := testutil.StartUntil(t, exec.Command("qemu-nbd", "-r", "-f", "qcow2", "-k", sock, p),
		func() bool { return fileExists(sock) })
	want := runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", "nbd+unix:///?socket="+sock)
	stop()
	srv := startNBD(t, nbdRun{args: []string{"-t", "-r", "-f", "qcow2", p}})
	got := runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", srv.uri)
	srv.stop(15)
	if got != want {
		t.Errorf("qemu-img map over ovis nbd:\n%s\nover qemu-nbd:\n%s", got, want)
	}
}
