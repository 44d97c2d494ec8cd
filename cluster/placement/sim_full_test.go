//go:build !race

package placement

// Outside the race detector the simulation runs at the scale.
const (
	defaultSimObjects = 10_000_000
	raceEnabled       = false
)
