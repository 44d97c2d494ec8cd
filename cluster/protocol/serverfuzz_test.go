package protocol

import (
	"context"
	"io"
	"net"
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
