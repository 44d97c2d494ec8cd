//go:build race

package img

func init() { raceEnabled = true }
