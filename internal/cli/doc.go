// Package cli holds kvxfer's command-line verbs (cobra). It parses flags,
// reads the environment once, calls into the packages that do the work and
// turns their results into output and an exit status. It holds no logic that
// a test of those packages could not reach.
package cli
