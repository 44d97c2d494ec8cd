package owner

import (
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// State is where a VDI's ownership is; see the package doc.
type State uint8

const (
	ReadOnly State = iota + 1
	Live
	Suspended
	Relocking
	Lost
	Revoked
	Closed
)

var stateNames = [...]string{ReadOnly: "read-only", Live: "live", Suspended: "suspended", Relocking: "relocking", Lost: "lost", Revoked: "revoked", Closed: "closed"}

func (s State) String() string {
	if int(s) < len(stateNames) && stateNames[s] != "" {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", s)
}

// Kind is what happened to a VDI's ownership.
type Kind uint8

const (
	// LeaseLost: the node's registration, which the lock is held under,
	// was fenced.
	LeaseLost Kind = iota + 1
	// Rejoined: the node registered again and begins taking the lock
	// again.
	Rejoined
	// Retaken: the lock was taken again (Event.Token) and that token
	// sent to every storage node.
	Retaken
	// Refused: the lock could not be taken again (Event.Why): another
	// owner has it, or the VDI is gone.
	Refused
	// Broken: the lock was broken while the lease it was held under
	// lived (Event.Why).
	Broken
	// Stale: a storage node refused Event.Token as stale (Event.Why).
	Stale
	// Abandon: the node closes before it took the lock again
	// (Event.Why).
	Abandon
	// Close: the VDI is closed here and its lock released.
	Close
)

var kindNames = [...]string{LeaseLost: "lease-lost", Rejoined: "rejoined", Retaken: "retaken", Refused: "refused", Broken: "broken", Stale: "stale", Abandon: "abandon", Close: "close"}

func (k Kind) String() string {
	if int(k) < len(kindNames) && kindNames[k] != "" {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", k)
}

// Event is one input of the machine.
type Event struct {
	Kind  Kind
	Token uint64 // Retaken: the new token; Stale: the refused one
	Why   error  // Refused, Broken, Stale, Abandon: the cause
}

var (
	// ErrLeaseLost is why a Lost machine refuses writes: the lease that
	// the VDI's lock was held under may have expired, and another owner
	// may have the lock.
	ErrLeaseLost = errors.New("the lease holding the VDI's lock may have expired; not writing")

	// ErrRevoked is why a Revoked machine refuses writes: the lock went
	// to another owner (broken, then taken with a higher token). It
	// wraps block.ErrReadOnly, so that NBD clients get EPERM, as for any
	// read-only export.
	ErrRevoked = fmt.Errorf("the VDI's lock was taken by another owner (stale fencing token); read-only now: %w", block.ErrReadOnly)
)

// Machine is one VDI's ownership. The zero Machine is not valid; start
// from Start.
type Machine struct {
	State State
	// Token is the fencing token writes carry; 0 for ReadOnly.
	Token uint64
	// Why is why writes are refused (Lost, Revoked): it wraps
	// ErrLeaseLost or ErrRevoked. Nil otherwise.
	Why error
}

// Start is the machine of a VDI opened with token: Live, or ReadOnly for
// token 0.
func Start(token uint64) Machine {
	if token == 0 {
		return Machine{State: ReadOnly}
	}
	return Machine{State: Live, Token: token}
}

// Next is the machine after e, and whether e changed it. An event that
// does not apply in m's state (a Retaken after the lease went again, a
// second loss, anything after Close) leaves m as it is.
func (m Machine) Next(e Event) (Machine, bool) {
	n := m
	switch {
	case e.Kind == Close:
		n = Machine{State: Closed, Token: m.Token, Why: m.Why}
	case m.State == Live && e.Kind == LeaseLost,
		m.State == Relocking && e.Kind == LeaseLost:
		n.State = Suspended
	case m.State == Suspended && e.Kind == Rejoined:
		n.State = Relocking
	case m.State == Relocking && e.Kind == Retaken && e.Token > m.Token:
		n.State, n.Token = Live, e.Token
	case (m.State == Suspended || m.State == Relocking) && (e.Kind == Refused || e.Kind == Abandon):
		n.State, n.Why = Lost, fmt.Errorf("%w: %w", ErrLeaseLost, e.Why)
	case (m.State == Live || m.State == Suspended || m.State == Relocking) && e.Kind == Broken,
		m.State == Live && e.Kind == Stale && e.Token == m.Token:
		n.State, n.Why = Revoked, fmt.Errorf("%w: %w", ErrRevoked, e.Why)
	}
	return n, n.State != m.State || n.Token != m.Token
}

// Holds reports whether requests wait in this state: the node is away,
// or taking the lock again.
func (m Machine) Holds() bool { return m.State == Suspended || m.State == Relocking }

// WriteErr is why a write may not start in this state, or nil: a Live
// machine admits writes (invariant 4).
func (m Machine) WriteErr() error {
	switch m.State {
	case Live:
		return nil
	case ReadOnly:
		return block.ErrReadOnly
	case Lost, Revoked:
		return m.Why
	case Closed:
		return block.ErrClosed
	}
	return fmt.Errorf("owner: no write while %s", m.State)
}
