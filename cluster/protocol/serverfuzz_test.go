package protocol

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// checkingHandler fails the fuzz run when a request reaches it that the
// op table should have refused.
type checkingHandler struct{ t testing.TB }

func (h checkingHandler) Serve(ctx context.Context, req *Request, resp *Response) {
	if st, msg := check(req, true, 0); st != StatusOK {
		h.t.Errorf("handler got a request the table refuses: %s: %s", st, msg)
	}
	if req.Op == OpRead {
		resp.Payload = resp.Payload[:0]
		resp.Payload = append(resp.Payload, make([]byte, req.Length)...)
	}
}

// FuzzServer feeds any bytes to a server over TCP: it never panics,
// never hands the handler a request the table refuses, answers with
// well-framed responses and closes the connection once the input ends.
func FuzzServer(f *testing.F) {
	for _, b := range fuzzRequests() {
		f.Add(b)
	}
	f.Add(append(fuzzRequests()[0], fuzzRequests()[1]...))
	ts := startServer(f, "tcp", checkingHandler{f}, ServerOptions{Logger: discardLogger(), MaxInFlight: 8})
	f.Fuzz(func(t *testing.T, in []byte) {
		conn, err := net.Dial("tcp", ts.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		wrote := make(chan error, 1)
		go func() {
			_, err := conn.Write(in)
			if err == nil {
				err = conn.(*net.TCPConn).CloseWrite()
			}
			wrote <- err
		}()
		var resp Response
		for {
			err := ReadResponse(conn, &resp)
			if err == io.EOF {
				break
			}
			if err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Fatalf("server still holds the connection 10 s after the input ended")
				}
				break // reset by the server after a framing error
			}
		}
		<-wrote
	})
}

// FuzzClient plays a hostile server: whatever bytes it answers with,
// every call returns (with a response or an error), nothing panics and
// the Client's goroutines end.
func FuzzClient(f *testing.F) {
	for _, r := range []*Response{
		{Handle: 1, Payload: make([]byte, 16)},
		{Handle: 2, Status: StatusNoEnt, Payload: []byte("gone")},
		{Handle: 3, Payload: AppendObjectInfos(nil, []ObjectInfo{{ID: 1}})},
	} {
		var b bytes.Buffer
		WriteResponse(&b, r)
		f.Add(b.Bytes())
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		a, b := net.Pipe()
		go func() {
			defer b.Close()
			go io.Copy(io.Discard, b) // take the requests
			b.Write(in)
		}()
		c := NewClient(a)
		var wg sync.WaitGroup
		for i, req := range []*Request{{Op: OpRead, Length: 16}, {Op: OpStat}, {Op: OpList}} {
			wg.Go(func() {
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				var resp Response
				err := c.Call(cctx, req, &resp)
				if errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("call %d hung", i)
				}
				if err == nil && req.Op == OpRead && len(resp.Payload) != 16 {
					t.Errorf("read of 16 returned %d bytes", len(resp.Payload))
				}
			})
		}
		wg.Wait()
		c.Close()
	})
}
