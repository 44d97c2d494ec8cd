package clustertest

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"time"
)

// Nemesis injects faults into a Cluster, one at a time, on a schedule
// drawn from Seed: it cuts one node off every other (long enough for it
// to leave the epoch), or one link between two nodes, and heals them;
// or it kills one to three nodes at once (which can take every holder
// of some objects down) and starts them again one at a time, each after
// 0.5 to 5 s, some slower than the lease; or it cuts one node off etcd
// alone for 1 to 6 s, some longer than the lease, so that it loses its
// lease and rejoins.
type Nemesis struct {
	C    *Cluster
	Seed uint64
	// Spare are the nodes the nemesis never kills or isolates (node 0
	// holds etcd; a test's writer may want its gateway kept). Their
	// links to others may still be cut one at a time.
	Spare []int
	// Logf, when set, is told each fault.
	Logf func(format string, args ...any)
}

// NemesisCounts says what a run injected.
type NemesisCounts struct {
	Cuts, Isolations, Kills, EtcdCuts int
}

func (c NemesisCounts) String() string {
	return fmt.Sprintf("%d cuts (%d isolations), %d kills, %d cuts off etcd", c.Cuts, c.Isolations, c.Kills, c.EtcdCuts)
}

// Run injects faults for dur or until ctx ends, then heals every link
// and starts every killed node again.
func (n *Nemesis) Run(ctx context.Context, dur time.Duration) NemesisCounts {
	rng := mrand.New(mrand.NewPCG(n.Seed, 99))
	var cnt NemesisCounts
	start := time.Now()
	logf := func(format string, args ...any) {
		if n.Logf != nil {
			n.Logf("%.1fs: "+format, append([]any{time.Since(start).Seconds()}, args...)...)
		}
	}
	sleep := func(d time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(d):
			return true
		}
	}
	var victims []int // may be killed or isolated
	for i := range n.C.Len() {
		if !slices.Contains(n.Spare, i) {
			victims = append(victims, i)
		}
	}
	for deadline := time.Now().Add(dur); time.Now().Before(deadline) && ctx.Err() == nil; {
		switch k := rng.IntN(7); {
		case k == 6 && len(victims) > 0:
			x := victims[rng.IntN(len(victims))]
			n.C.CutEtcd(x)
			cnt.EtcdCuts++
			hold := time.Duration(1000+rng.IntN(5000)) * time.Millisecond
			logf("cut n%d off etcd for %v", x, hold)
			sleep(hold)
			n.C.HealAll()
		case k < 2 && len(victims) > 0:
			killed := slices.Clone(victims)
			rng.Shuffle(len(killed), func(i, j int) { killed[i], killed[j] = killed[j], killed[i] })
			killed = killed[:1+rng.IntN(min(3, len(killed)))]
			for _, v := range killed {
				n.C.Kill(v)
			}
			cnt.Kills += len(killed)
			logf("killed %v", killed)
			for _, v := range killed {
				sleep(time.Duration(500+rng.IntN(4500)) * time.Millisecond)
				n.C.Restart(v)
				logf("n%d started again", v)
			}
		case k < 4 && len(victims) > 0:
			x := victims[rng.IntN(len(victims))]
			how := "isolated"
			if rng.IntN(2) == 0 {
				n.C.Isolate(x)
			} else {
				// Its dials fail at once, its peers' hang: it reports
				// them before they report it.
				how = "isolated (seeing it first)"
				for j := range n.C.Len() {
					if j != x {
						n.C.Drop(x, j)
					}
				}
			}
			cnt.Cuts++
			cnt.Isolations++
			hold := time.Duration(2500+rng.IntN(2500)) * time.Millisecond
			logf("%s n%d for %v", how, x, hold)
			sleep(hold)
			n.C.HealAll()
		default:
			a := rng.IntN(n.C.Len())
			b := rng.IntN(n.C.Len() - 1)
			if b >= a {
				b++
			}
			n.C.Cut(a, b)
			cnt.Cuts++
			hold := time.Duration(1000+rng.IntN(3000)) * time.Millisecond
			logf("cut n%d-n%d for %v", a, b, hold)
			sleep(hold)
			n.C.HealAll()
		}
		sleep(time.Duration(500+rng.IntN(1500)) * time.Millisecond)
	}
	n.C.HealAll()
	for i := range n.C.Len() {
		if !n.C.Up(i) {
			n.C.Restart(i)
		}
	}
	return cnt
}
