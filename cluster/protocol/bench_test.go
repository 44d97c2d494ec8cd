package protocol

import (
	"context"
	"fmt"
	"testing"
)

// sinkHandler acknowledges every request and keeps nothing.
type sinkHandler struct{}

func (sinkHandler) Serve(ctx context.Context, req *Request, resp *Response) { resp.Version = 1 }

// BenchmarkWrite: write calls over TCP loopback, one caller at a time
// (latency) and many at once on one connection (throughput).
func BenchmarkWrite(b *testing.B) {
	for _, size := range []int{4 << 10, 1 << 20} {
		for _, par := range []int{1, 16} {
			b.Run(fmt.Sprintf("%dKiB/callers=%d", size>>10, par), func(b *testing.B) {
				ts := startServer(b, "tcp", sinkHandler{}, ServerOptions{Logger: discardLogger()})
				p := NewPool(nil)
				defer p.Close()
				payload := make([]byte, size)
				for i := range payload {
					payload[i] = byte(i)
				}
				b.SetBytes(int64(size))
				b.ReportAllocs()
				b.ResetTimer()
				if par == 1 {
					var resp Response
					for range b.N {
						if err := p.Call(ctx, ts.addr, &Request{Op: OpWrite, Object: 1, Payload: payload}, &resp); err != nil {
							b.Fatal(err)
						}
					}
					return
				}
				b.SetParallelism(par)
				b.RunParallel(func(pb *testing.PB) {
					var resp Response
					for pb.Next() {
						if err := p.Call(ctx, ts.addr, &Request{Op: OpWrite, Object: 1, Payload: payload}, &resp); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
}
