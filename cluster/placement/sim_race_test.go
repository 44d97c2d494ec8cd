//go:build race

package placement

// Under the race detector, a tenth of the scale keeps the
// package's tests within a minute; the balance bound widens with the
// sampling noise (see balanceBound).
const defaultSimObjects = 300_000
