// Package memfd is Linux's anonymous memory files (memfd_create) the way
// kvxfer shares memory between processes of one host, on
// golang.org/x/sys/unix: a file created sealed against shrinking and growing
// (and, for memory a peer may only read, against writes) and mapped shared
// by its creator (New), and a peer's file mapped (Map, MapReadOnly) only
// once its seals make the mapping safe, because a file that can shrink under
// a mapping turns its reads into SIGBUS, which kills the process. It owns
// the system calls and those checks; what the memory holds, and who may get
// the file, belong to its callers (kvcache's ShmArena, transport/shm's
// windows).
//
// On other systems New, Map and MapReadOnly fail with an error wrapping
// errors.ErrUnsupported.
package memfd
