// Package buildinfo reports what this binary is: module version, VCS
// revision and Go version. Version and Revision may be set at link time
// (-ldflags "-X github.com/kvxfer/kvxfer/internal/buildinfo.Revision=...");
// otherwise they come from the Go build information.
package buildinfo
