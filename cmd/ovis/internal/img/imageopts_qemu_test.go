package img

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestImageOptsMessagesLikeQEMU: each way an --image-opts list can be
// wrong is reported in qemu-img's words, now that image.ParseOpts finds
// the mistake and this package words it.
func TestImageOptsMessagesLikeQEMU(t *testing.T) {
	dir := t.TempDir()
	q := filepath.Join(dir, "a.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", q, "1M")
	f := "file.filename=" + q
	for _, list := range []string{
		"driver=vmdk2," + f,
		"driver=qcow2,file.driver=nfs2," + f,
		"driver=qcow2,file=node0",
		"driver=raw," + f + ",l2-cache-size=1M",
		f + ",bogus=1",
		"driver=qcow2," + f + ",file.bogus=1",
		"driver=qcow2," + f + ",read-only=maybe",
		"driver=qcow2," + f + ",cache-size=1Q",
		"driver=qcow2," + f + ",cache-clean-interval=x",
		// Not file.locking=maybe: ovis says "Parameter 'locking' does
		// not accept value 'maybe'" where qemu-img 7.2 says "invalid
		// parameter value: maybe", as before this package used image.
		"driver=qcow2",
		"l2-cache-size=1M",
	} {
		out, code := testutil.QemuImgExit(t, "info", "--image-opts", list)
		if code == 0 {
			t.Fatalf("qemu-img info --image-opts %s succeeded", list)
		}
		want := strings.TrimSuffix(strings.TrimPrefix(out, "qemu-img: "), "\n")
		var e Env
		_, _, err := e.UseImageOpts(list)
		if err == nil || err.Error() != want {
			t.Errorf("%s:\n got %v\nwant %s", list, err, want)
		}
	}
}
