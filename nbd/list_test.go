package nbd_test

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/nbd"
)

// listLikeQemu lists the server at the unix socket sock with
// nbd.ListExports and nbd.WriteExportList, and with `qemu-nbd -L`, and
// fails the test unless both print the same (an error as qemu-nbd's
// error_report would print it) and agree on success.
func listLikeQemu(t *testing.T, what, sock string) string {
	t.Helper()
	qout, qerr, qok := tool(t, "qemu-nbd", "-L", "-k", sock)
	var out, errOut bytes.Buffer
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	list, err := nbd.ListExports(conn, nil)
	conn.Close()
	if err != nil {
		errOut.WriteString("qemu-nbd: " + err.Error() + "\n")
	} else if err := nbd.WriteExportList(&out, list); err != nil {
		t.Fatal(err)
	}
	if out.String() != qout || errOut.String() != qerr || (err == nil) != qok {
		t.Errorf("%s:\nqemu-nbd -L: ok %v\n%s%s\nListExports: ok %v\n%s%s", what, qok, qout, qerr, err == nil, out.String(), errOut.String())
	}
	t.Logf("%s:\n%s%s", what, out.String(), errOut.String())
	return out.String() + errOut.String()
}

// TestListExportsSeveral: a server with several exports (names with
// spaces and non-ASCII, descriptions, read-only, CAN_MULTI_CONN, dirty
// bitmaps, one without qemu:allocation-depth) lists as qemu-nbd -L lists
// it, over a unix socket.
func TestListExportsSeveral(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	clean := func(off, n int64) (int64, bool, error) { return n, false, nil }
	h := serve(t, nbd.Config{Exports: nbd.FixedExports(
		nbd.Export{Name: "", Device: openRaw(t, rawFile(t, dir, "a", 1<<20), false)},
		nbd.Export{Name: "second one", Description: "read-only, described", ReadOnly: true, Device: openRaw(t, rawFile(t, dir, "b", 4096), true)},
		nbd.Export{Name: "dégât", Description: "several connections", MultiConn: true, Device: openRaw(t, rawFile(t, dir, "c", 3<<20), false)},
		nbd.Export{Name: "bitmaps", Device: openRaw(t, rawFile(t, dir, "d", 64<<10), false),
			Bitmaps: []nbd.ExportBitmap{{Name: "b0", Extent: clean}, {Name: "b:1", Extent: clean}}},
		nbd.Export{Name: "no depth", NoAllocationDepth: true, Device: openRaw(t, rawFile(t, dir, "e", 64<<10), false),
			Bitmaps: []nbd.ExportBitmap{{Name: "b0", Extent: clean}}},
	)})
	got := listLikeQemu(t, "five exports", h.sock)
	if !strings.HasSuffix(got, " export: 'no depth'\n  size:  65536\n  flags: 0xced ( flush fua trim zeroes df cache fast-zero )\n"+
		"  min block: 1\n  opt block: 4096\n  max block: 33554432\n  available meta contexts: 2\n   base:allocation\n   qemu:dirty-bitmap:b0\n") {
		t.Errorf("NoAllocationDepth export listed as\n%s", got)
	}
	for _, want := range []string{"exports available: 5\n", " export: 'second one'\n  description: read-only, described\n",
		"flags: 0x48f ( readonly flush fua df cache )", "multi", "   qemu:dirty-bitmap:b:1\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("listing lacks %q:\n%s", want, got)
		}
	}
}

// Wire values a scripted server needs.
const (
	tInitMagic   = 0x4e42444d41474943 // NBDMAGIC
	tOptsMagic   = 0x49484156454F5054 // IHAVEOPT
	tClientMagic = 0x0000420281861253 // oldstyle
	tRepMagic    = 0x3e889045565a9
	tOptAbort    = 2
	tOptList     = 3
	tOptInfo     = 6
	tOptList2    = 9 // LIST_META_CONTEXT
	tRepAck      = 1
	tRepServer   = 2
	tRepInfo     = 3
	tRepMeta     = 4
	tErrUnsup    = 1<<31 | 1
	tErrPolicy   = 1<<31 | 2
	tErrTLSReqd  = 1<<31 | 5
)

// scripted serves every connection on a new unix socket with script and
// returns the socket's path.
func scripted(t *testing.T, script func(c net.Conn)) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				script(c)
			}()
		}
	}()
	return sock
}

func be64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// rep is an option reply.
func rep(opt, typ uint32, payload ...[]byte) []byte {
	b := be64(tRepMagic)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, typ)
	p := bytes.Join(payload, nil)
	b = binary.BigEndian.AppendUint32(b, uint32(len(p)))
	return append(b, p...)
}

// str is a 32-bit length and the string.
func str(s string) []byte { return append(binary.BigEndian.AppendUint32(nil, uint32(len(s))), s...) }

// newstyle greets with gflags, reads the client's flags, then answers
// each option with what answer returns, until ABORT or a hang-up.
func newstyle(gflags uint16, answer func(opt uint32, data []byte) []byte) func(net.Conn) {
	return func(c net.Conn) {
		g := append(be64(tInitMagic), be64(tOptsMagic)...)
		c.Write(binary.BigEndian.AppendUint16(g, gflags))
		var cf [4]byte
		if _, err := io.ReadFull(c, cf[:]); err != nil || gflags&1 == 0 {
			return
		}
		for {
			var hdr [16]byte
			if _, err := io.ReadFull(c, hdr[:]); err != nil {
				return
			}
			opt := binary.BigEndian.Uint32(hdr[8:])
			data := make([]byte, binary.BigEndian.Uint32(hdr[12:]))
			if _, err := io.ReadFull(c, data); err != nil || opt == tOptAbort {
				return
			}
			c.Write(answer(opt, data))
		}
	}
}

// TestListExportsLikeQemuOnOddServers: servers that fail or answer
// oddly — hang-ups, bad magic, no fixed newstyle, oldstyle, options
// refused with or without a message, NBD_OPT_INFO unsupported, a broken
// reply — give the listing and the error qemu-nbd -L gives.
func TestListExportsLikeQemuOnOddServers(t *testing.T) {
	t.Parallel()
	twoExports := func(opt uint32, data []byte) []byte {
		if opt == tOptList {
			return append(append(rep(opt, tRepServer, str("a")), rep(opt, tRepServer, str("b"), []byte("desc b"))...), rep(opt, tRepAck)...)
		}
		return rep(opt, tErrUnsup)
	}
	info := func(size uint64, flags uint16, block []uint32) []byte {
		e := binary.BigEndian.AppendUint16(nil, 0)
		e = binary.BigEndian.AppendUint64(e, size)
		e = binary.BigEndian.AppendUint16(e, flags)
		b := rep(tOptInfo, tRepInfo, e)
		if block != nil {
			p := binary.BigEndian.AppendUint16(nil, 3)
			for _, v := range block {
				p = binary.BigEndian.AppendUint32(p, v)
			}
			b = append(rep(tOptInfo, tRepInfo, p), b...)
		}
		return append(b, rep(tOptInfo, tRepAck)...)
	}
	for _, c := range []struct {
		name   string
		script func(net.Conn)
	}{
		{"hang-up", func(net.Conn) {}},
		{"half a magic", func(c net.Conn) { c.Write([]byte("NBDM")) }},
		{"bad magic", func(c net.Conn) { c.Write([]byte("garbage!garbage!")) }},
		{"bad server magic", func(c net.Conn) { c.Write(append(be64(tInitMagic), be64(1)...)) }},
		{"no flags", func(c net.Conn) { c.Write(append(be64(tInitMagic), be64(tOptsMagic)...)) }},
		{"not fixed newstyle", newstyle(0, nil)},
		{"oldstyle", func(c net.Conn) {
			b := append(append(be64(tInitMagic), be64(tClientMagic)...), be64(5<<20)...)
			b = binary.BigEndian.AppendUint32(b, 0x3)
			c.Write(append(b, make([]byte, 124)...))
			io.Copy(io.Discard, c)
		}},
		{"everything unsupported", newstyle(3, func(opt uint32, _ []byte) []byte { return rep(opt, tErrUnsup) })},
		{"TLS required", newstyle(3, func(opt uint32, _ []byte) []byte { return rep(opt, tErrTLSReqd, []byte("TLS is required")) })},
		{"list denied", newstyle(1, func(opt uint32, _ []byte) []byte {
			if opt == tOptList {
				return rep(opt, tErrPolicy)
			}
			return rep(opt, tRepAck)
		})},
		{"info unsupported", newstyle(3, twoExports)},
		{"info and contexts", newstyle(3, func(opt uint32, data []byte) []byte {
			switch opt {
			case tOptInfo:
				if strings.Contains(string(data), "b") {
					return info(1<<30, 0x1|0x2|0x8, nil)
				}
				return info(4096, 0x1|0x4|0x100, []uint32{512, 4096, 1 << 20})
			case tOptList2:
				id := binary.BigEndian.AppendUint32(nil, 1)
				if bytes.HasSuffix(data, []byte("qemu:")) {
					return append(rep(opt, tRepMeta, id, []byte("qemu:dirty-bitmap:x")), rep(opt, tRepAck)...)
				}
				return append(rep(opt, tRepMeta, id, []byte("base:allocation")), rep(opt, tRepAck)...)
			}
			if opt == 8 { // STRUCTURED_REPLY
				return rep(opt, tRepAck)
			}
			return twoExports(opt, data)
		})},
		{"info without export", newstyle(3, func(opt uint32, data []byte) []byte {
			if opt == tOptInfo {
				return rep(opt, tRepAck)
			}
			return twoExports(opt, data)
		})},
		{"bad block size", newstyle(3, func(opt uint32, data []byte) []byte {
			if opt == tOptInfo {
				return info(4096, 1, []uint32{3, 4096, 1 << 20})
			}
			return twoExports(opt, data)
		})},
		{"bad reply magic", newstyle(3, func(opt uint32, _ []byte) []byte { return make([]byte, 20) })},
		{"wrong option in reply", newstyle(3, func(opt uint32, _ []byte) []byte { return rep(opt+1, tRepAck) })},
	} {
		listLikeQemu(t, c.name, scripted(t, c.script))
	}
}
