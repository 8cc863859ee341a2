//go:build !race

package engine

// raceEnabled: the race detector is off.
const raceEnabled = false
