//go:build !invariants

package kvcache

// invariants is false in ordinary builds; see invariants_on.go.
const invariants = false
