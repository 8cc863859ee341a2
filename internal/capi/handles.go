package capi

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Table maps the integer handles C holds to Go values, so that no Go
// pointer is ever held by C. Handles count up from 1 and are never reused
// in a process; 0 is never a handle. The count is shared by every Table,
// so that a handle of one kind is never one of another: a config handle
// given where a transceiver's is due is refused (ErrBadHandle) rather than
// naming, or closing, the transceiver that shares its number. The zero
// Table is ready to use.
type Table[T any] struct {
	kind string // named in errors ("config", "transceiver")
	mu   sync.Mutex
	m    map[uint64]T
}

// lastHandle is the last handle any Table gave.
var lastHandle atomic.Uint64

// NewTable returns an empty table whose errors name kind.
func NewTable[T any](kind string) *Table[T] { return &Table[T]{kind: kind} }

// Put stores v and returns its new handle.
func (t *Table[T]) Put(v T) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[uint64]T{}
	}
	h := lastHandle.Add(1)
	t.m[h] = v
	return h
}

// Get returns the value of handle h, or an error wrapping ErrBadHandle.
func (t *Table[T]) Get(h uint64) (T, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[h]
	if !ok {
		return v, fmt.Errorf("%w: %s handle %d is not open (never returned, already closed, or of another kind)", ErrBadHandle, t.kind, h)
	}
	return v, nil
}

// Delete removes handle h and returns its value; ok is false when h was
// not in the table (already deleted: Close calls are idempotent).
func (t *Table[T]) Delete(h uint64) (v T, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok = t.m[h]
	delete(t.m, h)
	return v, ok
}

// Len returns the number of open handles.
func (t *Table[T]) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}
