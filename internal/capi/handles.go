package capi

import (
	"fmt"
	"sync"
)

// Table maps the integer handles C holds to Go values, so that no Go
// pointer is ever held by C. Handles count up from 1 and are never reused
// in a process; 0 is never a handle. The zero Table is ready to use.
type Table[T any] struct {
	kind string // named in errors ("config", "transceiver")
	mu   sync.Mutex
	next uint64
	m    map[uint64]T
}

// NewTable returns an empty table whose errors name kind.
func NewTable[T any](kind string) *Table[T] { return &Table[T]{kind: kind} }

// Put stores v and returns its new handle.
func (t *Table[T]) Put(v T) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[uint64]T{}
	}
	t.next++
	t.m[t.next] = v
	return t.next
}

// Get returns the value of handle h, or an error wrapping ErrBadHandle.
func (t *Table[T]) Get(h uint64) (T, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[h]
	if !ok {
		return v, fmt.Errorf("%w: %s handle %d is not open (never returned, or already closed)", ErrBadHandle, t.kind, h)
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
