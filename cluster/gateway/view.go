package gateway

import (
	"context"
	"fmt"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/placement"
)

// View is what the gateway needs of one membership epoch: where objects
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

// Supersede marks v as replaced by a newer view: calls still in flight
// on it are abandoned, and the gateway places them again by the newer
// view. The Views implementation calls it when it takes a newer view.
func (v *View) Supersede() {
	if v.end != nil {
		v.end()
	}
}

// attempt returns the context of one try of a request on v: ctx, ended
// early when v is superseded. stop releases it.
func (v *View) attempt(ctx context.Context) (context.Context, func()) {
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

// NewView builds the View of one epoch from its node list.
func NewView(epoch uint64, nodes []placement.Node, addrs map[string]string) (*View, error) {
	m, err := placement.New(nodes)
	if err != nil {
		return nil, fmt.Errorf("gateway: epoch %d: %w", epoch, err)
	}
	for _, n := range nodes {
		if addrs[n.ID] == "" {
			return nil, fmt.Errorf("gateway: epoch %d: node %s has no address", epoch, n.ID)
		}
	}
	life, end := context.WithCancel(context.Background())
	return &View{Epoch: epoch, Map: m, Addr: addrs, life: life, end: end}, nil
}

// Views hands the gateway the membership as it changes. Implementations
// are safe for concurrent use.
type Views interface {
	// View returns the newest view known; never nil.
	View() *View
	// Await returns a view of an epoch newer than epoch, waiting until
	// one is known or ctx ends.
	Await(ctx context.Context, epoch uint64) (*View, error)
}

// StaticViews is a Views that never changes, for tests and tools that
// pin one epoch.
type StaticViews struct{ V *View }

func (s StaticViews) View() *View { return s.V }

func (s StaticViews) Await(ctx context.Context, epoch uint64) (*View, error) {
	if s.V.Epoch > epoch {
		return s.V, nil
	}
	<-ctx.Done()
	return nil, fmt.Errorf("gateway: waiting for an epoch after %d: %w", epoch, ctx.Err())
}
