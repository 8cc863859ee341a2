// Package repotest holds repository-wide checks that belong to no single
// package: every package documents itself in a doc.go, and every import of
// every package is one that the boundary table (DESIGN.md's package table)
// allows, and no build output is tracked.
package repotest
