package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestNBDStopWithStuckRequests stops `ovis nbd` while it has requests in
// service that cannot finish: READs whose replies the client never reads,
// so that the server's reply writes block (the nearest a test outside the
// process comes to a device that never answers: ovis serves only local
// files, and nothing from outside makes a file's reads wait forever). A
// second client is attached and idle. SIGTERM, and Ctrl-C twice (the
// first only reports the clients), must stop the server within
// --shutdown-timeout and a margin, after waiting that long for the
// requests, with status 0; the acknowledged write must be in the image,
// which qemu-img check finds clean, and the socket must be gone.
func TestNBDStopWithStuckRequests(t *testing.T) {
	t.Parallel()
	const (
		grace  = 2 * time.Second
		margin = 5 * time.Second
	)
	for _, tc := range []struct {
		name    string
		signals []syscall.Signal
	}{
		{"SIGTERM", []syscall.Signal{syscall.SIGTERM}},
		{"Ctrl-C twice", []syscall.Signal{syscall.SIGINT, syscall.SIGINT}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			image, _ := newNBDImage(t, t.TempDir(), "qcow2", 64<<20)
			s := startNBD(t, nbdRun{args: []string{"-t", "-e", "2", "--shutdown-timeout", grace.String(), "-f", "qcow2", image}})

			dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			idle, err := dialNBD(dctx, "unix", s.addr, "")
			if err != nil {
				t.Fatal(err)
			}
			defer idle.c.Close()
			k, err := dialNBD(dctx, "unix", s.addr, "")
			if err != nil {
				t.Fatal(err)
			}
			defer k.c.Close()
			data := bytes.Repeat([]byte("stuck requests. "), 4096) // 64 KiB
			if err := k.write(dctx, 1<<20, data, false); err != nil {
				t.Fatalf("write: %v", err)
			}

			// 32 READs of 1 MiB, far more than the socket holds. Once
			// the first reply's header has come, that reply is in
			// service, and its data cannot all be sent.
			const reads, readLen = 32, 1 << 20
			var reqs []byte
			for i := range reads {
				var h [28]byte
				binary.BigEndian.PutUint32(h[0:4], nbdRequestMagic)
				binary.BigEndian.PutUint16(h[6:8], 0) // NBD_CMD_READ
				binary.BigEndian.PutUint64(h[8:16], uint64(100+i))
				binary.BigEndian.PutUint64(h[16:24], uint64(i)*readLen)
				binary.BigEndian.PutUint32(h[24:28], readLen)
				reqs = append(reqs, h[:]...)
			}
			if _, err := k.c.Write(reqs); err != nil {
				t.Fatalf("sending READs: %v", err)
			}
			k.c.SetReadDeadline(time.Now().Add(20 * time.Second))
			var rep [16]byte
			if _, err := io.ReadFull(k.r, rep[:]); err != nil {
				t.Fatalf("first READ reply: %v", err)
			}
			if binary.BigEndian.Uint32(rep[0:4]) != nbdReplyMagic || binary.BigEndian.Uint32(rep[4:8]) != 0 {
				t.Fatalf("first READ reply %x", rep)
			}

			for i, sig := range tc.signals {
				if i > 0 {
					waitStderr(t, s, "attached: serving until")
				}
				s.cmd.Process.Signal(sig)
			}
			start := time.Now()
			code := s.wait(grace + margin)
			took := time.Since(start)
			if code != 0 {
				t.Fatalf("ovis nbd exited with %d\n%s", code, s.stderr)
			}
			if took < grace-100*time.Millisecond {
				t.Errorf("stopped %v after the signal, before the grace %v: were no requests in service?", took, grace)
			}
			if !strings.Contains(s.stderr.String(), "requests in service did not finish in time") {
				t.Errorf("stderr does not report the cut requests:\n%s", s.stderr)
			}
			if _, err := os.Stat(s.addr); !os.IsNotExist(err) {
				t.Errorf("socket %s left behind (%v)", s.addr, err)
			}
			testutil.CheckImage(t, image)
			got := testutil.ConvertToRaw(t, image)
			if !bytes.Equal(got[1<<20:1<<20+len(data)], data) {
				t.Error("the acknowledged write is not in the image")
			}
		})
	}
}

// waitStderr waits until the server's stderr contains want.
func waitStderr(t *testing.T, s *nbdServer, want string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(s.stderr.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("stderr never said %q:\n%s", want, s.stderr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
