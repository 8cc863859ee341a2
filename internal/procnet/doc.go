// Package procnet reads Linux's TCP socket tables (/proc/<pid>/net/tcp and
// tcp6) and a process's descriptors (/proc/<pid>/fd), to tell which TCP
// listeners a process holds and on which addresses. Tests use it to check
// that every listener binds the address it was asked to; it owns nothing
// else and opens no socket of its own.
package procnet
