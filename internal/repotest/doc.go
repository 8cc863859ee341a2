// Package repotest holds repository-wide checks that belong to no single
// package: every package documents itself in a doc.go.
package repotest
