package nbd_test

// Interop: real clients (nbdinfo, qemu-io, qemu-img, nbdcopy, fio) against
// an in-process server over a unix socket and loopback TCP, serving raw
// files and qcow2 images.

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/nbd"
	"github.com/ovis-storage/ovis/qcow2"
)

// harness is one server listening on a unix socket and on loopback TCP.
type harness struct {
	t    *testing.T
	srv  *nbd.Server
	sock string
	tcp  string
}

// serve starts a server for cfg; it is shut down when the test ends.
func serve(t *testing.T, cfg nbd.Config) *harness {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = logger(t)
	}
	srv, err := nbd.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, srv: srv, sock: filepath.Join(t.TempDir(), "nbd.sock")}
	ul, err := net.Listen("unix", h.sock)
	if err != nil {
		t.Fatal(err)
	}
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.tcp = tl.Addr().String()
	errs := make(chan error, 2)
	for _, l := range []net.Listener{ul, tl} {
		go func() { errs <- srv.Serve(context.Background(), l) }()
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		for range 2 {
			if err := <-errs; !errors.Is(err, nbd.ErrServerClosed) {
				t.Errorf("Serve: %v", err)
			}
		}
	})
	return h
}

// unix returns the nbd+unix URI of an export.
func (h *harness) unix(export string) string {
	return "nbd+unix:///" + export + "?socket=" + h.sock
}

// tcpURI returns the nbd:// URI of an export.
func (h *harness) tcpURI(export string) string {
	return "nbd://" + h.tcp + "/" + export
}

func logger(t *testing.T) *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// tool runs a client tool and returns its output, its standard error and
// whether it exited 0. It fails the test when the tool is missing.
func tool(t *testing.T, name string, args ...string) (string, string, bool) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		t.Fatalf("%s is not installed (%v): apt-get install -y qemu-utils fio libnbd-bin nbdkit", name, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil && !errors.As(err, new(*exec.ExitError)) {
		t.Fatalf("%s %s: %v", name, strings.Join(args, " "), err)
	}
	return out.String(), errb.String(), err == nil
}

// mustTool is tool for runs that must succeed.
func mustTool(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, errs, ok := tool(t, name, args...)
	if !ok {
		t.Fatalf("%s %s failed\nstderr: %s\nstdout: %s", name, strings.Join(args, " "), errs, out)
	}
	return out
}

// rawFile creates a sparse raw file of size bytes.
func rawFile(t *testing.T, dir, name string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	return p
}

func openRaw(t *testing.T, path string, readOnly bool) *block.Raw {
	t.Helper()
	d, err := block.OpenRaw(path, readOnly)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func openQcow2(t *testing.T, path string, readOnly bool) *qcow2.Image {
	t.Helper()
	img, err := qcow2.Open(path, qcow2.Options{ReadOnly: readOnly})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { img.Close() })
	return img
}

// status is one run of a device as block status reports it.
type status struct {
	Start, Length int64
	Data, Zero    bool
	Depth         int
}

// deviceMap walks dev with Extent and merges adjacent runs that agree on
// what key keeps.
func deviceMap(t *testing.T, dev block.Device, key func(block.Extent) status) []status {
	t.Helper()
	var out []status
	for off := int64(0); off < dev.Size(); {
		e, err := block.FirstExtent(ctx, dev, off, dev.Size()-off)
		if err != nil || e.Length <= 0 {
			t.Fatalf("Extent(%d): %+v, %v", off, e, err)
		}
		s := key(e)
		s.Start, s.Length = off, e.Length
		if k := len(out) - 1; k >= 0 && out[k].Data == s.Data && out[k].Zero == s.Zero && out[k].Depth == s.Depth {
			out[k].Length += s.Length
		} else {
			out = append(out, s)
		}
		off += e.Length
	}
	return out
}

func allocation(e block.Extent) status {
	return status{Data: e.Status&block.StatusHole == 0, Zero: e.Status&block.StatusZero != 0}
}

func depth(e block.Extent) status { return status{Depth: e.Depth} }

func merge(in []status) []status {
	var out []status
	for _, s := range in {
		if k := len(out) - 1; k >= 0 && out[k].Data == s.Data && out[k].Zero == s.Zero && out[k].Depth == s.Depth && out[k].Start+out[k].Length == s.Start {
			out[k].Length += s.Length
			continue
		}
		out = append(out, s)
	}
	return out
}

// qemuIO runs qemu-io commands on a file or URI, with discards honoured.
func qemuIO(t *testing.T, target string, cmds []string) {
	t.Helper()
	args := []string{"-f", "raw", "-d", "unmap"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	args = append(args, target)
	out, errs, ok := tool(t, "qemu-io", args...)
	if !ok || strings.Contains(out+errs, "failed") {
		t.Fatalf("qemu-io on %s failed\nstderr: %s\nstdout: %s", target, errs, out)
	}
}

// scratchImages makes a qcow2 overlay over a qcow2 backing file:
// backing data in [0, 1 MiB), overlay data in [512 KiB, 768 KiB), overlay
// zeros in [2 MiB, 3 MiB), unallocated elsewhere; 4 MiB.
func scratchImages(t *testing.T, dir string) string {
	t.Helper()
	base := filepath.Join(dir, "base.qcow2")
	top := filepath.Join(dir, "top.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", base, "4M")
	testutil.QemuIO(t, base, "qcow2", "write -P 0x11 0 1M")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top)
	testutil.QemuIO(t, top, "qcow2", "write -P 0x22 512k 256k", "write -z 2M 1M")
	return top
}

// TestNbdinfo checks what nbdinfo sees: sizes, flags, contexts, the
// export list and both maps, over the unix socket and TCP.
func TestNbdinfo(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	scratch := rawFile(t, dir, "scratch.raw", 8<<20)
	shared := rawFile(t, dir, "shared.raw", 1<<20)
	top := scratchImages(t, dir)
	rawDev := openRaw(t, scratch, false)
	qcow := openQcow2(t, top, true)
	h := serve(t, nbd.Config{Exports: nbd.FixedExports(
		nbd.Export{Name: "", Description: "scratch disk", Device: rawDev},
		nbd.Export{Name: "ro", Description: "qcow2 overlay", Device: qcow, ReadOnly: true},
		nbd.Export{Name: "mc", Device: openRaw(t, shared, false), MultiConn: true},
	)})
	qemuIO(t, h.unix(""), []string{"write -P 0x33 1M 64k"})

	type info struct {
		Protocol   string `json:"protocol"`
		TLS        bool   `json:"TLS"`
		Structured bool   `json:"structured"`
		Exports    []struct {
			Name         string   `json:"export-name"`
			Description  string   `json:"description"`
			Contexts     []string `json:"contexts"`
			ReadOnly     bool     `json:"is_read_only"`
			CanCache     bool     `json:"can_cache"`
			CanDF        bool     `json:"can_df"`
			CanFastZero  bool     `json:"can_fast_zero"`
			CanFlush     bool     `json:"can_flush"`
			CanFUA       bool     `json:"can_fua"`
			CanMultiConn bool     `json:"can_multi_conn"`
			CanTrim      bool     `json:"can_trim"`
			CanZero      bool     `json:"can_zero"`
			MinBlock     int64    `json:"block_size_minimum"`
			PrefBlock    int64    `json:"block_size_preferred"`
			MaxBlock     int64    `json:"block_size_maximum"`
			Size         int64    `json:"export-size"`
		} `json:"exports"`
	}
	decode := func(out string) info {
		var i info
		if err := json.Unmarshal([]byte(out), &i); err != nil {
			t.Fatalf("nbdinfo json: %v\n%s", err, out)
		}
		return i
	}
	for _, uri := range []func(string) string{h.unix, h.tcpURI} {
		i := decode(mustTool(t, "nbdinfo", "--json", uri("")))
		e := i.Exports[0]
		if i.Protocol != "newstyle-fixed" || i.TLS || !i.Structured || len(i.Exports) != 1 {
			t.Errorf("%s: %+v", uri(""), i)
		}
		want := []bool{false, true, true, true, true, true, false, true, true}
		got := []bool{e.ReadOnly, e.CanCache, e.CanDF, e.CanFastZero, e.CanFlush, e.CanFUA, e.CanMultiConn, e.CanTrim, e.CanZero}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("flags [ro cache df fastzero flush fua multiconn trim zero] = %v, want %v", got, want)
		}
		if e.Size != 8<<20 || e.Description != "scratch disk" || e.MinBlock != 1 || e.PrefBlock != 4096 || e.MaxBlock != 32<<20 {
			t.Errorf("export: %+v", e)
		}
		if fmt.Sprint(e.Contexts) != "[base:allocation qemu:allocation-depth]" {
			t.Errorf("contexts %v", e.Contexts)
		}
		ro := decode(mustTool(t, "nbdinfo", "--json", uri("ro"))).Exports[0]
		if !ro.ReadOnly || ro.CanTrim || ro.CanZero || ro.CanFastZero || !ro.CanFlush || ro.Size != 4<<20 {
			t.Errorf("read-only export: %+v", ro)
		}
		if mc := decode(mustTool(t, "nbdinfo", "--json", uri("mc"))).Exports[0]; !mc.CanMultiConn {
			t.Errorf("multi-conn export: %+v", mc)
		}
		list := decode(mustTool(t, "nbdinfo", "--json", "--list", uri("")))
		var names []string
		for _, e := range list.Exports {
			names = append(names, e.Name+"="+e.Description)
		}
		if fmt.Sprint(names) != "[=scratch disk ro=qcow2 overlay mc=]" {
			t.Errorf("list: %v", names)
		}
	}

	// Maps: nbdinfo's against the device's own extents.
	type entry struct {
		Offset int64  `json:"offset"`
		Length int64  `json:"length"`
		Type   uint32 `json:"type"`
	}
	nbdMap := func(uri, context string, conv func(uint32) status) []status {
		out := mustTool(t, "nbdinfo", "--json", "--map="+context, uri)
		var es []entry
		if err := json.Unmarshal([]byte(out), &es); err != nil {
			t.Fatalf("nbdinfo --map json: %v\n%s", err, out)
		}
		var got []status
		for _, e := range es {
			s := conv(e.Type)
			s.Start, s.Length = e.Offset, e.Length
			got = append(got, s)
		}
		return merge(got)
	}
	fromFlags := func(f uint32) status { return status{Data: f&1 == 0, Zero: f&2 != 0} }
	fromDepth := func(f uint32) status { return status{Depth: int(f)} }
	for _, c := range []struct {
		export string
		dev    block.Device
	}{{"", rawDev}, {"ro", qcow}} {
		for _, uri := range []string{h.unix(c.export), h.tcpURI(c.export)} {
			if got, want := nbdMap(uri, "base:allocation", fromFlags), deviceMap(t, c.dev, allocation); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("%s base:allocation map\n got %v\nwant %v", uri, got, want)
			}
			if got, want := nbdMap(uri, "qemu:allocation-depth", fromDepth), deviceMap(t, c.dev, depth); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("%s qemu:allocation-depth map\n got %v\nwant %v", uri, got, want)
			}
		}
	}
	// The overlay's depths, spelled out: backing, local, backing,
	// unallocated, local zeros, unallocated.
	want := "[{0 524288 false false 2} {524288 262144 false false 1} {786432 262144 false false 2} {1048576 1048576 false false 0} {2097152 1048576 false false 1} {3145728 1048576 false false 0}]"
	if got := fmt.Sprint(nbdMap(h.unix("ro"), "qemu:allocation-depth", fromDepth)); got != want {
		t.Errorf("overlay depth map %s, want %s", got, want)
	}
}

// randomOps returns qemu-io commands: pattern writes (some FUA, some
// unaligned), zero writes with and without unmap, discards and reads.
// Discards are cluster aligned: a discard of part of a qcow2 cluster may
// leave the old bytes, which a raw file would not.
func randomOps(seed uint64, size int64, n int) []string {
	r := rand.New(rand.NewPCG(seed, 1))
	var ops []string
	for i := 0; i < n; i++ {
		off := r.Int64N(size / 4096)
		l := 1 + r.Int64N(min(64, size/4096-off))
		switch k := r.IntN(10); {
		case k < 4:
			ops = append(ops, fmt.Sprintf("write -P %#x %d %d", 1+r.IntN(254), off*4096, l*4096))
		case k == 4:
			ops = append(ops, fmt.Sprintf("write -f -P %#x %d %d", 1+r.IntN(254), off*4096, l*4096))
		case k == 5:
			o := off*4096 + r.Int64N(4096)
			ops = append(ops, fmt.Sprintf("write -P %#x %d %d", 1+r.IntN(254), o, min(1+r.Int64N(10000), size-o)))
		case k == 6:
			ops = append(ops, fmt.Sprintf("write -z %d %d", off*4096, l*4096))
		case k == 7:
			ops = append(ops, fmt.Sprintf("write -z -u %d %d", off*4096, l*4096))
		case k == 8:
			c := off * 4096 / 65536
			cl := max(1, l*4096/65536)
			if (c+cl)*65536 <= size {
				ops = append(ops, fmt.Sprintf("discard %d %d", c*65536, cl*65536))
			}
		default:
			ops = append(ops, fmt.Sprintf("read %d %d", off*4096, l*4096))
		}
	}
	ops = append(ops, "flush")
	return ops
}

// TestQemuIOMirror applies the same random operations through NBD and to
// a reference raw file with qemu-io, then compares them with qemu-img
// compare while the server runs, over both transports.
func TestQemuIOMirror(t *testing.T) {
	t.Parallel()
	const size = 16 << 20
	for _, kind := range []string{"raw", "qcow2"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			var dev block.Device
			if kind == "raw" {
				dev = openRaw(t, rawFile(t, dir, "disk.raw", size), false)
			} else {
				p := filepath.Join(dir, "disk.qcow2")
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p, fmt.Sprint(size))
				dev = openQcow2(t, p, false)
			}
			ref := rawFile(t, dir, "ref.raw", size)
			h := serve(t, nbd.Config{Exports: nbd.FixedExports(nbd.Export{Device: dev})})
			for i, target := range []string{h.unix(""), h.tcpURI("")} {
				ops := randomOps(uint64(i+1), size, 120)
				qemuIO(t, target, ops)
				qemuIO(t, ref, ops)
				for _, uri := range []string{h.unix(""), h.tcpURI("")} {
					if out, errs, ok := tool(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", uri, ref); !ok {
						t.Fatalf("qemu-img compare %s %s: %s %s", uri, ref, out, errs)
					}
				}
			}
			testutil.CompareDeviceWithRaw(t, block.ReaderAt(ctx, dev), size, ref)
		})
	}
}

// TestQemuImgMap: `qemu-img map` over NBD agrees with the device's
// extents.
func TestQemuImgMap(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	top := scratchImages(t, dir)
	raw := rawFile(t, dir, "sparse.raw", 8<<20)
	rawDev := openRaw(t, raw, false)
	qcow := openQcow2(t, top, false)
	h := serve(t, nbd.Config{Exports: nbd.FixedExports(nbd.Export{Name: "raw", Device: rawDev}, nbd.Export{Name: "qcow2", Device: qcow})})
	qemuIO(t, h.unix("raw"), []string{"write -P 1 64k 64k", "write -P 2 1M 3M", "write -z -u 2M 512k", "write -z 3M 64k"})
	qemuIO(t, h.unix("qcow2"), []string{"write -P 3 3M 128k", "discard 512k 64k"})
	for _, c := range []struct {
		name string
		dev  block.Device
	}{{"raw", rawDev}, {"qcow2", qcow}} {
		for _, uri := range []string{h.unix(c.name), h.tcpURI(c.name)} {
			var got []status
			for _, e := range testutil.Map(t, uri) {
				got = append(got, status{Start: e.Start, Length: e.Length, Data: e.Data, Zero: e.Zero})
			}
			got = merge(got)
			want := deviceMap(t, c.dev, allocation)
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("qemu-img map %s\n got %v\nwant %v", uri, got, want)
			}
		}
	}
}

// TestNbdcopy copies a sparse raw file into an export and back out with
// nbdcopy and compares the bytes.
func TestNbdcopy(t *testing.T) {
	t.Parallel()
	const size = 16 << 20
	dir := t.TempDir()
	src := rawFile(t, dir, "src.raw", size)
	f, err := os.OpenFile(src, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(3, 3))
	for i := 0; i < 40; i++ {
		b := make([]byte, 1+r.IntN(300<<10))
		for j := range b {
			b[j] = byte(r.Uint32())
		}
		f.WriteAt(b, r.Int64N(size-int64(len(b))))
	}
	f.Close()
	want, _ := os.ReadFile(src)

	p := filepath.Join(dir, "dst.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p, fmt.Sprint(size))
	h := serve(t, nbd.Config{Exports: nbd.FixedExports(
		nbd.Export{Name: "raw", Device: openRaw(t, rawFile(t, dir, "dst.raw", size), false), MultiConn: true},
		nbd.Export{Name: "qcow2", Device: openQcow2(t, p, false), MultiConn: true},
	)})
	for _, c := range []struct{ uri, out string }{
		{h.unix("raw"), "out1.raw"},
		{h.tcpURI("qcow2"), "out2.raw"},
	} {
		mustTool(t, "nbdcopy", src, c.uri)
		out := filepath.Join(dir, c.out)
		mustTool(t, "nbdcopy", c.uri, out)
		got, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("nbdcopy round trip through %s differs", c.uri)
		}
	}
}

// TestFio runs fio's nbd engine: four jobs, each its own connection to a
// multi-conn export, random writes of mixed sizes verified with crc32c,
// over a raw file and over a qcow2 image with small clusters (many
// concurrent allocations); the image must check clean afterwards.
func TestFio(t *testing.T) {
	t.Parallel()
	const perJob = 8 << 20
	for _, kind := range []string{"raw", "qcow2"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			var dev block.Device
			p := filepath.Join(dir, "fio."+kind)
			if kind == "raw" {
				dev = openRaw(t, rawFile(t, dir, "fio.raw", 4*perJob), false)
			} else {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", p, fmt.Sprint(4*perJob))
				dev = openQcow2(t, p, false)
			}
			h := serve(t, nbd.Config{Exports: nbd.FixedExports(nbd.Export{Device: dev, MultiConn: true})})
			out := mustTool(t, "fio",
				"--name=nbd", "--ioengine=nbd", "--uri="+h.unix(""),
				"--rw=randwrite", "--bsrange=512-64k", "--iodepth=8", "--numjobs=4",
				fmt.Sprintf("--size=%d", perJob), fmt.Sprintf("--offset_increment=%d", perJob),
				"--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--verify_state_save=0",
				"--group_reporting", "--output-format=json")
			var rep struct {
				Jobs []struct {
					Error int `json:"error"`
					Read  struct {
						IOBytes int64 `json:"io_bytes"`
					} `json:"read"`
					Write struct {
						IOBytes int64 `json:"io_bytes"`
					} `json:"write"`
				} `json:"jobs"`
			}
			if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &rep); err != nil || len(rep.Jobs) != 1 {
				t.Fatalf("fio json (%v): %s", err, out)
			}
			j := rep.Jobs[0]
			if j.Error != 0 || j.Write.IOBytes < 4*perJob || j.Read.IOBytes != j.Write.IOBytes {
				t.Errorf("fio: error %d, wrote %d, verified %d bytes; want 0, at least %d, all", j.Error, j.Write.IOBytes, j.Read.IOBytes, 4*perJob)
			}
			if kind == "qcow2" {
				if err := dev.Flush(ctx); err != nil {
					t.Fatal(err)
				}
				testutil.CheckImage(t, p)
			}
		})
	}
}

// TestTLS: nbdinfo over TLS with libnbd's certificate folder succeeds on
// both transports; a plain client is refused before it can list exports;
// with a client CA pool, a client without a certificate is refused.
func TestTLS(t *testing.T) {
	t.Parallel()
	pki := nbd.NewTestPKI(t)
	dir := t.TempDir()
	exports := nbd.FixedExports(nbd.Export{Name: "secret-export", Description: "hidden", Device: openRaw(t, rawFile(t, dir, "disk.raw", 4<<20), false)})
	serverTLS := &tls.Config{Certificates: []tls.Certificate{pki.Server}}
	open := serve(t, nbd.Config{Exports: exports, TLS: serverTLS})
	strict := serve(t, nbd.Config{Exports: exports, TLS: serverTLS, ClientCAs: pki.CAPool})

	tlsUnix := func(h *harness, certs string) string {
		return "nbds+unix:///secret-export?socket=" + h.sock + "&tls-certificates=" + certs
	}
	tlsTCP := func(h *harness, certs string) string {
		return "nbds://" + h.tcp + "/secret-export?tls-certificates=" + certs
	}
	for _, c := range []struct {
		uri string
		ok  bool
	}{
		{tlsUnix(open, pki.ClientDir), true},
		{tlsTCP(open, pki.ClientDir), true},
		{tlsUnix(open, pki.CADir), true},
		{tlsUnix(strict, pki.ClientDir), true},
		{tlsTCP(strict, pki.ClientDir), true},
		{tlsUnix(strict, pki.CADir), false},
		{tlsTCP(strict, pki.CADir), false},
	} {
		out, errs, ok := tool(t, "nbdinfo", "--json", c.uri)
		if ok != c.ok {
			t.Errorf("nbdinfo %s: ok=%v, want %v\n%s%s", c.uri, ok, c.ok, out, errs)
			continue
		}
		if ok && (!strings.Contains(out, `"TLS": true`) || !strings.Contains(out, `"export-size": 4194304`)) {
			t.Errorf("nbdinfo %s:\n%s", c.uri, out)
		}
	}
	// Plain clients: refused, and no export name leaks.
	for _, uri := range []string{open.unix(""), open.tcpURI(""), open.unix("secret-export")} {
		for _, args := range [][]string{{"--list", uri}, {uri}} {
			out, errs, ok := tool(t, "nbdinfo", args...)
			if ok || strings.Contains(out+errs, "secret-export\"") || strings.Contains(out+errs, "hidden") {
				t.Errorf("plain nbdinfo %v: ok=%v\n%s%s", args, ok, out, errs)
			}
		}
	}
}
