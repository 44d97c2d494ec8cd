//go:build race

package placement

// Under the race detector, a thirtieth of the scale keeps the
// package's tests within a minute; the balance bound widens with the
// sampling noise (see balanceBound), and the 4096-vnode ring, which is
// only compared, not asserted, is left out.
const (
	defaultSimObjects = 300_000
	raceEnabled       = true
)
