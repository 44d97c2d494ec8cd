package clustertest

import (
	"context"
	mrand "math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/histcheck"
)

// TestHistory is the history test on the in-process harness, with the
// partitions the process test's nemesis lacks: five nodes, copies 3.
// Two clients write unique self-checking values (FUA, or write then
// flush) to 32 blocks through the writer's gateway (n0), and three read
// them through n1, n2 and n3, while the Nemesis, drawn from a seed,
// isolates nodes, cuts links, and kills one to three of n1..n4 at once
// and starts them again. At the end every block is read through every
// gateway, and internal/histcheck judges the history: no acknowledged
// write lost, no read back in time, no torn block, no value never
// written.
//
// OVIS_SIM_DURATION (default 15s) and OVIS_SIM_SEED (default: the
// clock, logged) change the run.
func TestHistory(t *testing.T) {
	dur := 15 * time.Second
	if s := os.Getenv("OVIS_SIM_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("OVIS_SIM_DURATION: %v", err)
		}
		dur = d
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("OVIS_SIM_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("OVIS_SIM_SEED: %v", err)
		}
		seed = v
	}
	t.Logf("seed %d (OVIS_SIM_SEED), %v", seed, dur)
	ctx, cancel := context.WithTimeout(context.Background(), dur+3*time.Minute)
	defer cancel()

	const (
		nodeCount = 5
		objects   = 16
		regs      = 2 * objects // a block at the start and one in the middle of each 1 MiB object
	)
	c := Start(t, Options{Nodes: nodeCount})
	c.Format(ctx, 3)
	c.CreateVDI(ctx, "disk", objects<<20, 20)
	c.AwaitNodes(nodeCount)
	offset := func(reg int) int64 { return int64(reg/2)<<20 + int64(reg%2)*(512<<10) }
	exp, err := c.Open(ctx, 0, "disk")
	if err != nil || exp.ReadOnly {
		t.Fatalf("open through n0: %v (read-only %v)", err, exp != nil && exp.ReadOnly)
	}
	writer := exp.Device
	start := time.Now()
	since := func() time.Duration { return time.Since(start) }
	var rec histcheck.Recorder
	var next atomic.Uint64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for cl := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(seed, uint64(cl)))
			for {
				select {
				case <-stop:
					return
				default:
				}
				reg := rng.IntN(regs)
				v := next.Add(1)
				op := histcheck.Op{Kind: histcheck.Write, Register: reg, Value: v, Client: cl, Gateway: 0, Start: since()}
				octx, ocancel := context.WithTimeout(ctx, 30*time.Second)
				var err error
				if rng.IntN(2) == 0 {
					op.Mode = "fua"
					_, err = writer.WriteAt(octx, histcheck.Encode(reg, v), offset(reg), block.FUA)
				} else {
					op.Mode = "flush"
					if _, err = writer.WriteAt(octx, histcheck.Encode(reg, v), offset(reg), 0); err == nil {
						err = writer.Flush(octx)
					}
				}
				ocancel()
				op.End, op.Outcome = since(), histcheck.OK
				if err != nil {
					op.Outcome, op.End, op.Err = histcheck.Failed, histcheck.Never, err.Error()
				}
				rec.Add(op)
			}
		}()
	}
	read := func(dev block.Device, client, gw, reg int) {
		op := histcheck.Op{Kind: histcheck.Read, Register: reg, Client: client, Gateway: gw, Start: since()}
		b := make([]byte, histcheck.BlockSize)
		octx, ocancel := context.WithTimeout(ctx, 30*time.Second)
		_, err := dev.ReadAt(octx, b, offset(reg))
		ocancel()
		op.End, op.Outcome, op.Data = since(), histcheck.OK, b
		if err != nil {
			op.Outcome, op.Data, op.Err = histcheck.Failed, nil, err.Error()
		}
		rec.Add(op)
	}
	for g := 1; g <= 3; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(seed, uint64(10+g)))
			var dev block.Device
			for {
				select {
				case <-stop:
					return
				default:
				}
				nd := c.Node(g)
				if dev == nil {
					// Opened again after the gateway's node was killed.
					exp, err := nd.Open(ctx, "disk")
					if err != nil {
						time.Sleep(50 * time.Millisecond)
						continue
					}
					dev = exp.Device
				}
				read(dev, 10+g, g, rng.IntN(regs))
				select {
				case <-nd.Done():
					dev = nil
				default:
				}
			}
		}()
	}

	epoch0 := c.Node(0).View().Epoch
	nem := &Nemesis{C: c, Seed: seed, Spare: []int{0}, Logf: t.Logf}
	counts := nem.Run(ctx, dur)
	close(stop)
	wg.Wait()
	c.AwaitNodes(nodeCount)

	// Every block through every gateway.
	for g := range nodeCount {
		exp, err := c.Open(ctx, g, "disk")
		if err != nil {
			t.Fatalf("open through n%d at the end: %v", g, err)
		}
		for reg := range regs {
			read(exp.Device, 100+g, g, reg)
		}
	}
	rep, err := histcheck.Check(rec.Ops())
	if err != nil {
		t.Fatal(err)
	}
	epochs := c.Node(0).View().Epoch - epoch0
	t.Logf("%v, %d epochs; %s", counts, epochs, rep.Summary(20))
	if len(rep.Violations) > 0 {
		t.Fatalf("the history has violations (seed %d)", seed)
	}
	if counts.Isolations+counts.Kills+counts.EtcdCuts > 0 && epochs < 2 {
		t.Errorf("%v made %d new epochs: no node left", counts, epochs)
	}
	cn := rep.Counts
	if cn.WritesOK == 0 || cn.ReadsOK < regs*nodeCount {
		t.Fatalf("too little happened to judge: %+v", cn)
	}
	final := 0
	for _, op := range rec.Ops() {
		if op.Kind == histcheck.Read && op.Client >= 100 && op.Outcome != histcheck.OK {
			final++
		}
	}
	if final > 0 {
		t.Fatalf("%d of the final reads failed, with every node back and every link healed", final)
	}
	if r, err := c.Check(ctx); err != nil || len(r.Bad) > 0 {
		t.Logf("cluster check right after the run (recovery may still run): %v %+v", err, r.Bad)
	}
}
