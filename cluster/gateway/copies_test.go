package gateway_test

import (
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/placement"
	"github.com/ovis-storage/ovis/cluster/view"
)

// TestCopiesOfTheView: a write goes to as many replicas as the VDI has
// copies in the epoch of the view that placed it: the view's table when
// it lists the VDI, else the record's value for that epoch
// (Config.CopiesAt), else Config.Copies.
func TestCopiesOfTheView(t *testing.T) {
	c := newCluster(t, 4, 5)
	var pn []placement.Node
	addrs := map[string]string{}
	for _, n := range c.nodes {
		pn = append(pn, placement.Node{ID: n.id, Weight: 1})
		addrs[n.id] = n.addr
	}
	for _, tc := range []struct {
		name     string
		table    map[object.VDI]int
		copiesAt func(uint64) int
		want     int
	}{
		{"no table, no history", nil, nil, 2},
		{"the view's table", map[object.VDI]int{7: 3}, nil, 3},
		{"the table wins over the history", map[object.VDI]int{7: 4}, func(uint64) int { return 1 }, 4},
		{"not in the table: the record's for the epoch", map[object.VDI]int{8: 3}, func(e uint64) int {
			if e == 5 {
				return 1
			}
			return 3
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := view.New(5, pn, addrs)
			if err != nil {
				t.Fatal(err)
			}
			v.Copies = tc.table
			d, err := gateway.Open(ctx, gateway.Config{
				VDI: 7, Name: "test", Size: 1 << 20, Copies: 2, CopiesAt: tc.copiesAt, ObjectShift: object.MinSizeShift,
				Token: 1, Views: view.Static{V: v}, Net: c.net, RetryTimeout: 5 * time.Second,
			})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			c.net.reset()
			if _, err := d.WriteAt(ctx, fill(1, 4096), 0, 0); err != nil {
				t.Fatal(err)
			}
			if got := c.net.get("write"); got != tc.want {
				t.Fatalf("the write went to %d replicas, want %d", got, tc.want)
			}
		})
	}
}
