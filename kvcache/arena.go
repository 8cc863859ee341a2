package kvcache

import (
	"fmt"
	"math"
	"os"
	"sync"

	"github.com/kvxfer/kvxfer/internal/memfd"
)

// An Allocator provides the memory of a Pool: one contiguous region, so that
// a network backend can register the whole pool as a single memory region.
//
// Implementations must be safe for concurrent use. The caller of Allocate
// owns the returned Arena and must Close it when done; a Pool owns the arena
// it allocated and closes it in Pool.Close.
type Allocator interface {
	// Allocate returns a new arena whose Bytes are exactly size bytes long
	// and zeroed. size must be positive.
	Allocate(size int) (Arena, error)
}

// An Arena is a contiguous region of memory that backs a Pool.
//
// Bytes may be called any number of times and from several goroutines; it
// returns the same slice each time until Close, and nil after. The slice
// aliases the region: it may be retained and written, but no slice obtained
// from it may be used after Close. For mmap and shm arenas, touching the
// memory after Close faults and kills the process.
//
// Close releases the region. It is idempotent: the first call releases and
// reports any error, later calls do nothing and return nil. Close may be
// called concurrently with Bytes but not with uses of the memory.
type Arena interface {
	Bytes() []byte
	Close() error
}

// HeapAllocator allocates arenas on the Go heap. It is the default, needs no
// privileges and works everywhere, but its memory can be neither shared with
// another process nor pinned for a NIC; the garbage collector frees it once
// the arena is closed and no slice of it is reachable.
type HeapAllocator struct{}

// Allocate returns a zeroed arena of size bytes on the Go heap.
func (HeapAllocator) Allocate(size int) (Arena, error) {
	if err := checkArenaSize(int64(size)); err != nil {
		return nil, err
	}
	return &heapArena{b: make([]byte, size)}, nil
}

type heapArena struct {
	mu sync.Mutex
	b  []byte // nil once closed
}

func (a *heapArena) Bytes() []byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.b
}

func (a *heapArena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.b = nil
	return nil
}

// MmapAllocator allocates arenas as private anonymous memory mappings
// (mmap MAP_PRIVATE|MAP_ANONYMOUS). The memory is page-aligned and lives
// outside the Go heap, so the garbage collector never scans or moves it and
// Close returns it to the operating system at once.
//
// It needs a Unix system; elsewhere Allocate returns an error wrapping
// errors.ErrUnsupported.
type MmapAllocator struct {
	// Populate pre-faults every page at allocation time (MAP_POPULATE, Linux
	// only; ignored elsewhere), so that the first transfer into the pool does
	// not pay for page faults. It makes Allocate take time proportional to
	// the size.
	Populate bool
}

// ShmAllocator allocates arenas in shared memory that another process can
// map: an anonymous memory file (memfd_create with MFD_CLOEXEC), sized with
// ftruncate, sealed against shrinking and growing, and mapped MAP_SHARED.
// The arenas it returns are *ShmArena; their File can be sent to a peer over
// a Unix socket (SCM_RIGHTS), which maps it with MapShared.
//
// It needs Linux; elsewhere Allocate returns an error wrapping
// errors.ErrUnsupported.
type ShmAllocator struct {
	// Name labels the memory file in /proc/<pid>/maps and /proc/<pid>/fd
	// (as "/memfd:<Name>"); it has no other meaning. Empty means "kvxfer".
	Name string

	// Populate pre-faults every page at allocation time, as in MmapAllocator.
	Populate bool

	// PeerReadOnly seals the file against writes (F_SEAL_FUTURE_WRITE)
	// once the arena's own mapping exists: the arena can still be written
	// through Bytes, but no descriptor of the file, in this process or one
	// it was passed to, can write it or map it writable again. Use it for
	// memory a peer may read and must never change.
	PeerReadOnly bool
}

// ShmArena is an arena in shared memory: the one ShmAllocator creates, or a
// peer's mapping of it made by MapShared. A backend gets it from
// Pool.Arena with a type assertion.
//
// The ShmArena owns its file: Close unmaps the memory and closes the file.
// Callers may use File (for example to send it over a Unix socket, which
// duplicates the descriptor) but must not close it or change its size.
type ShmArena struct {
	m *memfd.Mapping
}

// Bytes returns the mapped memory, or nil after Close.
func (a *ShmArena) Bytes() []byte { return a.m.Bytes() }

// File returns the memory file behind the arena, to be passed to another
// process, or nil for an arena made by MapShared (which does not keep the
// descriptor it was given) and after Close. The file stays owned by the
// arena.
func (a *ShmArena) File() *os.File { return a.m.File() }

// Size returns the size of the arena in bytes: the size a peer passes to
// MapShared. It stays valid after Close.
func (a *ShmArena) Size() int64 { return a.m.Size() }

// Close unmaps the memory and closes the file. It is idempotent. Other
// processes' mappings of the same file are unaffected; the memory is freed
// when the last mapping and the last descriptor are gone.
func (a *ShmArena) Close() error { return a.m.Close() }

func checkArenaSize(size int64) error {
	if size <= 0 || size > maxArenaSize {
		return fmt.Errorf("kvcache: arena size %d out of range 1..%d", size, int64(maxArenaSize))
	}
	return nil
}

// maxArenaSize is the largest arena: 128 TiB, below the largest heap
// allocation of 64-bit platforms (asking make for more panics), or the
// largest slice length of 32-bit ones.
const maxArenaSize = min(math.MaxInt, 1<<47)
