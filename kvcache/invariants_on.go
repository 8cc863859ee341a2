//go:build invariants

package kvcache

// invariants is true in builds with the invariants tag: misuse of the pool
// (double free, bad block ids) panics instead of returning an error, and
// every mutating Pool operation re-checks the pool's internal consistency.
// It is meant for tests (go test -tags invariants); it makes every pool
// operation O(number of blocks).
const invariants = true
