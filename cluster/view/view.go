// Package view is what requests of one membership epoch are placed by:
// the epoch, its placement map, the nodes' addresses and the VDIs'
// copies in it (View), and the source that hands out newer ones as the
// membership changes (Source). The gateway, recovery, ranking and the
// CLI all read epochs through it; it sits below all of them.
package view

import (
	"context"
	"fmt"
	"slices"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/placement"
)

// View is what a request needs of one membership epoch: where objects
// go and how to reach the nodes.
type View struct {
	Epoch uint64
	Map   *placement.Map
	// Addr maps a node's ID to its node-to-node address.
	Addr map[string]string
	// Copies are the VDIs' copies in this epoch: a request in an epoch
	// uses the copies the VDI had when the epoch was written (see
	// membership.AlterCopies), so a gateway never writes fewer replicas
	// than recovery made. The node fills it from the VDI table read once
	// the epoch was known. A VDI it lacks (created after that read, or a
	// view without the table: nil) takes Config's copies. Read-only once
	// the view is handed out.
	Copies map[object.VDI]int

	// life ends when a newer view supersedes this one (Supersede); a
	// View built as a literal has none and is never superseded.
	life context.Context
	end  context.CancelFunc
}

// IDs returns the IDs of every node of v's epoch, placed or not (a full
// node is in Addr but not in Map), sorted.
func (v *View) IDs() []string {
	ids := make([]string, 0, len(v.Addr))
	for id := range v.Addr {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Supersede marks v as replaced by a newer view: calls still in flight
// on it are abandoned, and the gateway places them again by the newer
// view. The Views implementation calls it when it takes a newer view.
func (v *View) Supersede() {
	if v.end != nil {
		v.end()
	}
}

// Attempt returns the context of one try of a request on v: ctx, ended
// early when v is superseded. stop releases it.
func (v *View) Attempt(ctx context.Context) (context.Context, func()) {
	if v.life == nil {
		return ctx, func() {}
	}
	actx, cancel := context.WithCancel(ctx)
	unhook := context.AfterFunc(v.life, cancel)
	return actx, func() {
		unhook()
		cancel()
	}
}

// New builds the View of one epoch from its node list.
func New(epoch uint64, nodes []placement.Node, addrs map[string]string) (*View, error) {
	m, err := placement.New(nodes)
	if err != nil {
		return nil, fmt.Errorf("view: epoch %d: %w", epoch, err)
	}
	for _, n := range nodes {
		if addrs[n.ID] == "" {
			return nil, fmt.Errorf("view: epoch %d: node %s has no address", epoch, n.ID)
		}
	}
	life, end := context.WithCancel(context.Background())
	return &View{Epoch: epoch, Map: m, Addr: addrs, life: life, end: end}, nil
}

// Source hands out the membership's views as it changes.
// Implementations are safe for concurrent use.
type Source interface {
	// View returns the newest view known; never nil.
	View() *View
	// Await returns a view of an epoch newer than epoch, waiting until
	// one is known or ctx ends.
	Await(ctx context.Context, epoch uint64) (*View, error)
}

// Static is a Source that never changes, for tests and tools that pin
// one epoch.
type Static struct{ V *View }

func (s Static) View() *View { return s.V }

func (s Static) Await(ctx context.Context, epoch uint64) (*View, error) {
	if s.V.Epoch > epoch {
		return s.V, nil
	}
	<-ctx.Done()
	return nil, fmt.Errorf("view: waiting for an epoch after %d: %w", epoch, ctx.Err())
}
