//go:build race

package engine

// raceEnabled: the race detector is on, so pool memory is read by
// instrumented Go code, never by assembly it cannot see.
const raceEnabled = true
