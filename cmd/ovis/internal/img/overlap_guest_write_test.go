package img

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// markingLine is the line QEMU prints when it marks an image corrupt.
const markingLine = "qcow2: Marking image as corrupt: Preventing invalid write on metadata (overlaps with active L2 table); further corruption events will be suppressed\n"

// TestReproOverlapGuestWriteLikeQemu (the verb in process, runVerb): an image whose refcount block calls
// its active L2 table free is written by convert -n and (as a commit's
// base) by commit. QEMU's overlap check refuses the write that would land
// on the table: the command fails, the image is marked corrupt and its
// data still reads back. ovis refuses alike instead of overwriting the
// table.
func TestReproOverlapGuestWriteLikeQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", base, "64M")
	testutil.QemuIO(t, base, "qcow2", "write -q -P 0x11 0 64k")
	b, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	// Refcount of the L2 table (cluster 4) in refcount block 0 → 0.
	be := binary.BigEndian
	rb := be.Uint64(b[be.Uint64(b[48:]):])
	l2 := be.Uint64(b[be.Uint64(b[40:]):]) & (1<<56 - 1) &^ 0x1ff
	be.PutUint16(b[rb+2*(l2>>16):], 0)
	src := filepath.Join(dir, "src.raw")
	testutil.QemuImg(t, "create", "-q", "-f", "raw", src, "64M")
	testutil.QemuIO(t, src, "raw", "write -q -P 0x11 0 64k", "write -q -P 0x22 1M 64k")

	for _, verb := range []string{"convert", "commit"} {
		t.Run(verb, func(t *testing.T) {
			var res [2]testutil.Output
			for i, tool := range []string{"qemu-img", "ovis"} {
				d := filepath.Join(dir, verb+"-"+tool)
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
				img := filepath.Join(d, "img.qcow2")
				if err := os.WriteFile(img, b, 0o644); err != nil {
					t.Fatal(err)
				}
				args := []string{"convert", "-n", "-f", "raw", "-O", "qcow2", src, img}
				if verb == "commit" {
					ov := filepath.Join(d, "overlay.qcow2")
					testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-b", img, "-F", "qcow2", ov)
					testutil.QemuIO(t, ov, "qcow2", "write -q -P 0x22 1M 64k")
					args = []string{"commit", ov}
				}
				if tool == "ovis" {
					res[i] = runVerb(func(ctx context.Context, e *Env) error {
						if verb == "commit" {
							return e.Commit(ctx, CommitConfig{Filename: filepath.Join(d, "overlay.qcow2")})
						}
						return e.Convert(ctx, ConvertConfig{Sources: []string{src}, SourceFormat: "raw", Dest: img,
							DestFormat: "qcow2", NoCreate: true, Workers: DefaultWorkers})
					})
				} else {
					res[i] = qemuImg(t, d, args...)
				}
				info := testutil.ImageInfo(t, img)
				spec, _ := info["format-specific"].(map[string]any)
				data, _ := spec["data"].(map[string]any)
				if data["corrupt"] != true {
					t.Errorf("%s %s: image not marked corrupt", tool, verb)
				}
				out, errs, code := testutil.RunIn(t, d, "qemu-io", "-r", "-U", "-f", "qcow2", "-c", "read -q -P 0x11 0 64k", img)
				if code != 0 || strings.Contains(out+errs, "fail") {
					t.Errorf("%s %s: data no longer reads back: %s%s", tool, verb, out, errs)
				}
				if fi, err := os.Stat(img); err != nil || fi.Size() > 1<<20 {
					t.Errorf("%s %s: image grew to %d bytes", tool, verb, fi.Size())
				}
			}
			q, o := res[0], res[1]
			if q.Code != 1 || o.Code != q.Code {
				t.Errorf("exit: qemu-img %d, ovis %d", q.Code, o.Code)
			}
			if !strings.HasPrefix(q.Stderr, markingLine) {
				t.Errorf("qemu-img did not report the overlap: %q", q.Stderr)
			}
			// ovis reports the event as QEMU does, before the failure,
			// and the request fails with EIO.
			if !strings.HasPrefix(o.Stderr, markingLine) || !strings.HasSuffix(o.Stderr, ": Input/output error\n") {
				t.Errorf("ovis: %q, want the marking line and an Input/output error as qemu-img's %q", o.Stderr, q.Stderr)
			}
			if qe, oe := testutil.NormStderr(q.Stderr), testutil.NormStderr(o.Stderr); qe != oe {
				t.Errorf("stderr differs:\nqemu-img %q\n    ovis %q", qe, oe)
			}
		})
	}
}
