package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// Sources for the convert tests, built with QEMU's tools.
var (
	// rawSource is a 64 MiB sparse raw file with data at aligned and
	// unaligned offsets, an all-zero run inside data, and data in its
	// last sector.
	rawSource = after(qemuCreate("-f raw src 64M",
		run("qemu-io", "-f", "raw",
			"-c", "write -P 0xaa 0 1M",
			"-c", "write -P 0xbb 1500000 70000",
			"-c", "write -P 0 1200000 100000",
			"-c", "write -P 0xcc 5M 3M",
			"-c", "write -P 0 6M 64k",
			"-c", "write -P 0xdd 40000000 5",
			"-c", "write -P 0xee 67108352 512",
			"src")))
	// qcow2Source is a qcow2 image with data, a zero cluster, a
	// compressed cluster and a partly written cluster.
	qcow2Source = qcow2SourceWith("")
)

func qcow2SourceWith(opts string) func(t *testing.T, dir string) string {
	args := "-f qcow2 src 64M"
	if opts != "" {
		args = "-f qcow2 -o " + opts + " src 64M"
	}
	return qemuCreate(args,
		run("qemu-io", "-f", "qcow2",
			"-c", "write -P 0xaa 0 1M",
			"-c", "write -P 0xbb 1500000 70000",
			"-c", "write -z 3M 1M",
			"-c", "write -c -P 0xcc 8M 64k",
			"-c", "write -P 0xdd 40000000 5",
			"src"))
}

// TestConvertRoundTrip converts sources to qcow2 with many option sets
// and back to raw, and requires clean images (qemu-img check) with the
// source's content (qemu-img compare) at each step, and a result that
// qemu-img info describes as it describes qemu-img convert's.
func TestConvertRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		src   func(t *testing.T, dir string) string
		args  string // convert arguments before SRC DST
		noRaw bool   // skip the way back to raw
	}{
		{"raw to qcow2", rawSource, "-O qcow2", false},
		{"raw to qcow2 compressed", rawSource, "-c -O qcow2", false},
		{"raw to qcow2 zstd compressed", rawSource, "-c -O qcow2 -o compression_type=zstd", false},
		{"raw to qcow2 4k clusters", rawSource, "-O qcow2 -o cluster_size=4k", false},
		{"raw to qcow2 4k clusters compressed", rawSource, "-c -O qcow2 -o cluster_size=4k", false},
		{"raw to qcow2 512 clusters", rawSource, "-O qcow2 -o cluster_size=512", false},
		{"raw to qcow2 2M clusters compressed", rawSource, "-c -O qcow2 -o cluster_size=2M,compression_type=zstd", false},
		{"raw to qcow2 v2", rawSource, "-O qcow2 -o compat=0.10", false},
		{"raw to qcow2 v2 compressed", rawSource, "-c -O qcow2 -o compat=0.10", false},
		{"raw to qcow2 extended l2", rawSource, "-O qcow2 -o extended_l2=on", false},
		{"raw to qcow2 extended l2 compressed", rawSource, "-c -O qcow2 -o extended_l2=on,cluster_size=32k", false},
		{"raw to qcow2 refcount bits 1", rawSource, "-O qcow2 -o refcount_bits=1", false},
		{"raw to qcow2 lazy refcounts", rawSource, "-O qcow2 -o lazy_refcounts=on", false},
		{"raw to qcow2 data file", rawSource, "-O qcow2 -o data_file=dst.data", false},
		{"raw to qcow2 prealloc metadata", rawSource, "-O qcow2 -o preallocation=metadata", false},
		{"raw to qcow2 no sparse", rawSource, "-O qcow2 -S 0", false},
		{"raw to qcow2 sparse 64k", rawSource, "-O qcow2 -S 64k", false},
		{"raw to qcow2 one worker", rawSource, "-O qcow2 -m 1", false},
		{"raw to raw", rawSource, "-O raw", true},
		{"raw to raw probing", rawSource, "", true},
		{"raw to raw falloc", rawSource, "-O raw -o preallocation=falloc", true},
		{"qcow2 to qcow2", qcow2Source, "-O qcow2", false},
		{"qcow2 to qcow2 compressed", qcow2Source, "-f qcow2 -c -O qcow2", false},
		{"qcow2 to raw", qcow2Source, "-O raw", true},
		{"zstd qcow2 to zstd compressed", qcow2SourceWith("compression_type=zstd"), "-c -O qcow2 -o compression_type=zstd", false},
		{"4k qcow2 to 64k", qcow2SourceWith("cluster_size=4k"), "-O qcow2", false},
		{"v2 qcow2 to v3", qcow2SourceWith("compat=0.10,cluster_size=16k"), "-O qcow2", false},
		{"extended l2 qcow2 to raw", qcow2SourceWith("extended_l2=on"), "-O raw", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			odir, qdir := t.TempDir(), t.TempDir()
			src := tt.src(t, odir)
			if err := os.Link(filepath.Join(odir, src), filepath.Join(qdir, src)); err != nil {
				t.Fatal(err)
			}
			args := append(strings.Fields(tt.args), src, "dst")
			mustOvisImg(t, odir, append([]string{"convert"}, args...)...)
			if r := qemuImg(t, qdir, append([]string{"convert"}, args...)...); r.code != 0 {
				t.Fatalf("qemu-img convert %s: %s", tt.args, r.stderr)
			}
			checkConverted(t, odir, src, "dst")
			oi, qi := infoFor(t, filepath.Join(odir, "dst")), infoFor(t, filepath.Join(qdir, "dst"))
			if fmt.Sprint(oi) != fmt.Sprint(qi) {
				t.Errorf("qemu-img info of ovis's output differs from that of qemu-img's\n    ovis: %v\nqemu-img: %v", oi, qi)
			}
			sparseAsQemu(t, filepath.Join(odir, "dst"), filepath.Join(qdir, "dst"))
			if tt.noRaw {
				return
			}
			mustOvisImg(t, odir, "convert", "-O", "raw", "dst", "back.raw")
			checkConverted(t, odir, src, "back.raw")
			sparseAsQemu(t, filepath.Join(odir, "back.raw"), filepath.Join(odir, src))
		})
	}
}

// checkConverted requires dst, in dir, to be clean and to read as src.
func checkConverted(t *testing.T, dir, src, dst string) {
	t.Helper()
	if r := qemuImg(t, dir, "check", dst); r.code != 0 && !strings.Contains(r.stderr, "does not support checks") {
		t.Errorf("qemu-img check %s: exit %d\n%s%s", dst, r.code, r.stdout, r.stderr)
	}
	if r := qemuImg(t, dir, "compare", src, dst); r.code != 0 {
		t.Errorf("qemu-img compare %s %s: exit %d\n%s%s", src, dst, r.code, r.stdout, r.stderr)
	}
}

// sparseAsQemu requires the ovis-made file to take at most a little more
// space than the reference: half again, plus 256 KiB for metadata
// placement.
func sparseAsQemu(t *testing.T, ovisPath, refPath string) {
	t.Helper()
	o, q := testutil.AllocatedBytes(t, ovisPath), testutil.AllocatedBytes(t, refPath)
	if o > q+q/2+256<<10 {
		t.Errorf("%s takes %d bytes on disk, the reference %s only %d", ovisPath, o, refPath, q)
	}
}

// TestConvertBacking converts the top of a backing chain onto a new
// backing file (-B, or -o backing_file): only the top layer may be copied,
// and the result must read as the source and map as qemu-img's result.
func TestConvertBacking(t *testing.T) {
	chain := after(qemuCreate("-f qcow2 -b base.raw -F raw src",
		run("qemu-io", "-f", "qcow2",
			"-c", "write -P 2 1M 1M",
			"-c", "write -z 3M 1M",
			"-c", "write -P 5 30M 100k",
			"-c", "write -P 0 40M 64k",
			"src")),
		run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64M"),
		run("qemu-io", "-f", "raw", "-c", "write -P 1 0 8M", "-c", "write -P 3 60M 1M", "base.raw"))
	rawTop := after(qemuCreate("-f raw src 64M",
		run("qemu-io", "-f", "raw", "-c", "write -P 9 2M 1M", "src")),
		run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64M"),
		run("qemu-io", "-f", "raw", "-c", "write -P 1 0 8M", "base.raw"))
	tests := []struct {
		name string
		src  func(t *testing.T, dir string) string
		args string
	}{
		{"-B", chain, "-O qcow2 -B base.raw -F raw"},
		{"-o backing_file", chain, "-O qcow2 -o backing_file=base.raw,backing_fmt=raw"},
		{"-B compressed", chain, "-c -O qcow2 -B base.raw -F raw"},
		{"-B 4k clusters", chain, "-O qcow2 -B base.raw -F raw -o cluster_size=4k"},
		{"-B extended l2", chain, "-O qcow2 -B base.raw -F raw -o extended_l2=on"},
		{"-B with a source without backing", rawTop, "-O qcow2 -B base.raw -F raw"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			odir, qdir := t.TempDir(), t.TempDir()
			tt.src(t, odir)
			tt.src(t, qdir)
			args := append([]string{"convert"}, strings.Fields(tt.args)...)
			args = append(args, "src", "dst")
			mustOvisImg(t, odir, args...)
			if r := qemuImg(t, qdir, args...); r.code != 0 {
				t.Fatalf("qemu-img %s: %s", strings.Join(args, " "), r.stderr)
			}
			checkConverted(t, odir, "src", "dst")
			if got, want := layerMap(t, odir), layerMap(t, qdir); got != want {
				t.Errorf("qemu-img map of dst\n    ovis: %s\nqemu-img: %s", got, want)
			}
		})
	}
}

// layerMap summarizes `qemu-img map` of dir/dst by layer and status,
// merging neighbours that differ only in host offset.
func layerMap(t *testing.T, dir string) string {
	t.Helper()
	r := qemuImg(t, dir, "map", "--output=json", "dst")
	if r.code != 0 {
		t.Fatalf("qemu-img map: %s", r.stderr)
	}
	var m []testutil.MapEntry
	if err := json.Unmarshal([]byte(r.stdout), &m); err != nil {
		t.Fatal(err)
	}
	type run struct {
		start, length int64
		key           string
	}
	var runs []run
	for _, e := range m {
		present := e.Present == nil || *e.Present
		key := fmt.Sprintf("depth=%d present=%v zero=%v data=%v", e.Depth, present, e.Zero, e.Data)
		if n := len(runs); n > 0 && runs[n-1].key == key {
			runs[n-1].length += e.Length
			continue
		}
		runs = append(runs, run{e.Start, e.Length, key})
	}
	var b strings.Builder
	for _, r := range runs {
		fmt.Fprintf(&b, "\n  [%d +%d] %s", r.start, r.length, r.key)
	}
	return b.String()
}

// TestConvertSparseTiB converts a 1 TiB qcow2 image holding 2 MiB of data
// to raw: the copy must skip the holes, leaving a file of under 16 MiB on
// disk, and finish quickly.
func TestConvertSparseTiB(t *testing.T) {
	dir := t.TempDir()
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "big.qcow2"), "1T")
	testutil.QemuIO(t, filepath.Join(dir, "big.qcow2"), "qcow2",
		"write -P 7 0 512k", "write -P 8 512G 512k", "write -P 9 700G 512k", "write -P 10 1048064M 512k")
	for _, args := range [][]string{
		{"convert", "-O", "raw", "big.qcow2", "big.raw"},
		{"convert", "-p", "-O", "raw", "big.qcow2", "big2.raw"},
	} {
		start := time.Now()
		r := mustOvisImg(t, dir, args...)
		elapsed := time.Since(start)
		out := args[len(args)-1]
		if got := testutil.AllocatedBytes(t, filepath.Join(dir, out)); got >= 16<<20 {
			t.Errorf("%s takes %d bytes on disk, want < 16 MiB", out, got)
		}
		if elapsed > 60*time.Second {
			t.Errorf("converting 1 TiB with 2 MiB of data took %v", elapsed)
		}
		if args[1] == "-p" && !strings.HasSuffix(r.stdout, "    (100.00/100%)\r\n") {
			t.Errorf("-p printed no finished progress: %q", r.stdout)
		}
		checkConverted(t, dir, "big.qcow2", out)
	}
	// And back into a compressed qcow2, which must stay small too.
	mustOvisImg(t, dir, "convert", "-c", "-O", "qcow2", "big.raw", "small.qcow2")
	checkConverted(t, dir, "big.raw", "small.qcow2")
	if got := testutil.AllocatedBytes(t, filepath.Join(dir, "small.qcow2")); got >= 16<<20 {
		t.Errorf("small.qcow2 takes %d bytes on disk, want < 16 MiB", got)
	}
}

// TestConvertNoSparse checks -S 0: every byte of the raw output is
// allocated.
func TestConvertNoSparse(t *testing.T) {
	dir := t.TempDir()
	rawSource(t, dir)
	mustOvisImg(t, dir, "convert", "-S", "0", "-O", "raw", "src", "dst")
	checkConverted(t, dir, "src", "dst")
	if got := testutil.AllocatedBytes(t, filepath.Join(dir, "dst")); got < 64<<20 {
		t.Errorf("-S 0 output takes %d bytes on disk, want all 64 MiB", got)
	}
}

// TestConvertExisting checks -n: an existing output full of other data is
// overwritten, zeros included.
func TestConvertExisting(t *testing.T) {
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			dir := t.TempDir()
			rawSource(t, dir)
			testutil.QemuImg(t, "create", "-q", "-f", format, filepath.Join(dir, "dst"), "64M")
			testutil.QemuIO(t, filepath.Join(dir, "dst"), format, "write -P 0x55 0 64M")
			mustOvisImg(t, dir, "convert", "-n", "-O", format, "src", "dst")
			checkConverted(t, dir, "src", "dst")
		})
	}
}

// TestConvertErrorsMatchQemu compares messages and exit codes of failing
// conversions.
func TestConvertErrorsMatchQemu(t *testing.T) {
	tests := []struct{ name, args string }{
		{"compress raw", "-c -O raw src dst"},
		{"compress prealloc", "-c -O qcow2 -o preallocation=full src dst"},
		{"sparse not sector multiple", "-S 1000 -O raw src dst"},
		{"sparse too big", "-S 32M -O raw src dst"},
		{"sparse bad", "-S 1X -O raw src dst"},
		{"no workers", "-m 0 -O raw src dst"},
		{"too many workers", "-m 17 -O raw src dst"},
		{"unknown format", "-O foo src dst"},
		{"one file", "-O qcow2 src"},
		{"missing source", "-O qcow2 nonexist dst"},
		{"wrong source format", "-f qcow2 -O raw src dst"},
		{"unknown source format", "-f vmdk2 -O raw src dst"},
		{"backing without format", "-O qcow2 -B src src dst"},
		{"backing format without backing", "-O qcow2 -F raw src dst"},
		{"bad cluster size", "-O qcow2 -o cluster_size=3k src dst"},
		{"unknown option", "-O qcow2 -o foo=1 src dst"},
		{"existing output missing", "-n -O raw src nonexist"},
		{"existing output too small", "-n -O raw src small"},
		{"missing folder", "-O raw src nonexist/dst"},
		{"help qcow2", "-O qcow2 -o help"},
		{"help raw with names", "-o help src dst"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := t.TempDir(), t.TempDir()
			for _, dir := range []string{qdir, odir} {
				testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(dir, "src"), "10M")
				testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(dir, "small"), "1M")
			}
			args := append([]string{"convert"}, strings.Fields(tt.args)...)
			q := qemuImg(t, qdir, args...)
			o := ovisImg(t, odir, args...)
			if tt.name == "help raw with names" {
				// QEMU lists the file protocol's nocow and
				// extent_size_hint, which ovis does not support.
				q.stdout = strings.NewReplacer(
					"  extent_size_hint=<size> - Extent size hint for the image file, 0 to disable\n", "",
					"  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)\n", "").Replace(q.stdout)
			}
			sameResult(t, strings.Join(args, " "), q, o)
		})
	}
}
