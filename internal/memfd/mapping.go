package memfd

import (
	"os"
	"sync"
)

// Options are the options of New.
type Options struct {
	// Populate pre-faults every page at creation (MAP_POPULATE), so that
	// the first use does not pay for page faults; New then takes time
	// proportional to the size.
	Populate bool
	// PeerReadOnly seals the file against writes (F_SEAL_FUTURE_WRITE)
	// once the creator's own mapping exists: the memory stays writable
	// through Bytes, but no descriptor of the file, in this process or one
	// it was passed to, can write it or map it writable again.
	PeerReadOnly bool
}

// Mapping is a shared mapping of a memory file: the one New made, which
// owns its file, or a peer's file mapped by Map or MapReadOnly, which keeps
// no descriptor. Its methods are safe for concurrent use; a nil *Mapping is
// an empty, closed one.
type Mapping struct {
	mu   sync.Mutex
	b    []byte   // nil once closed
	f    *os.File // nil for a peer's mapping
	size int64
}

// Bytes returns the mapped memory, or nil after Close.
func (m *Mapping) Bytes() []byte {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.b
}

// File returns the memory file, for a peer to map, or nil for a peer's
// mapping and after Close. The Mapping keeps owning it: a caller may pass
// it on (a Unix socket duplicates the descriptor) but must neither close it
// nor change its size.
func (m *Mapping) File() *os.File {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.f // nil once closed
}

// Size returns the size of the mapping in bytes; it stays valid after
// Close.
func (m *Mapping) Size() int64 {
	if m == nil {
		return 0
	}
	return m.size
}

// Close unmaps the memory and closes the file, if the Mapping owns one.
// Idempotent. Other mappings of the file, in this process or another, are
// unaffected; the memory is freed when the last mapping and the last
// descriptor are gone.
func (m *Mapping) Close() error {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.b == nil {
		return nil
	}
	err := unmap(m.b)
	m.b = nil
	if m.f != nil {
		if cerr := m.f.Close(); err == nil {
			err = cerr
		}
		m.f = nil
	}
	return err
}
