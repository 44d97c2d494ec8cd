package node

import (
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
)

// BenchmarkDeviceRead4K: 4 KiB reads at random offsets of a written
// 16 MiB VDI through one node's gateway (its own copy, copies 1), one
// at a time (qd1) and from 16 goroutines (qd16): the read path's CPU
// and locks, without NBD and the network (docs/benchmarks.md, the read
// model's cost).
func BenchmarkDeviceRead4K(b *testing.B) {
	ctx := context.Background()
	n, err := Start(ctx, Config{Dir: b.TempDir(), Listen: "127.0.0.1:0", EtcdListen: "http://127.0.0.1:0", EtcdPeer: "http://127.0.0.1:0",
		LeaseTTL: 4 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Close(ctx)
	if err := n.mc.Format(ctx, membership.Format{Copies: 1}, false); err != nil {
		b.Fatal(err)
	}
	if _, err := n.mc.CreateVDI(ctx, membership.VDI{Name: "disk", Size: 16 << 20}); err != nil {
		b.Fatal(err)
	}
	exp, err := n.vdis.Lookup(ctx, "disk")
	if err != nil {
		b.Fatal(err)
	}
	dev := exp.Device
	buf := make([]byte, 1<<20)
	for off := int64(0); off < 16<<20; off += 1 << 20 {
		if _, err := dev.WriteAt(ctx, buf, off, 0); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("qd1", func(b *testing.B) {
		p := make([]byte, 4096)
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if _, err := dev.ReadAt(ctx, p, int64(rand.IntN(4096))*4096); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("qd16", func(b *testing.B) {
		b.ReportAllocs()
		b.SetParallelism(8) // with GOMAXPROCS 2: 16 readers
		b.RunParallel(func(pb *testing.PB) {
			p := make([]byte, 4096)
			for pb.Next() {
				if _, err := dev.ReadAt(ctx, p, int64(rand.IntN(4096))*4096); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}
