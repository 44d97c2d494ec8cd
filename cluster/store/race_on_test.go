//go:build race

package store

// raceEnabled shortens the tests that run a child process under strace,
// which the race detector slows tenfold.
const raceEnabled = true
