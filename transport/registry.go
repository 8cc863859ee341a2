package transport

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
)

// ErrNotBuilt is wrapped by the availability error of a backend that exists
// in kvxfer but was left out of this binary by a build tag.
var ErrNotBuilt = errors.New("transport: not built in this binary")

// ErrUnknownBackend is returned for a name no backend uses.
var ErrUnknownBackend = errors.New("transport: unknown backend")

// Status is a backend's availability in this binary.
type Status struct {
	// Name is the backend's lower-case name ("tcp", "shm", "ucx").
	Name string
	// Err is nil when the backend can be used, else why not.
	Err error
}

// Available reports whether the backend can be used in this binary.
func (s Status) Available() bool { return s.Err == nil }

type entry struct {
	backend Backend // nil when unavailable
	err     error
}

var (
	mu       sync.RWMutex
	registry = map[string]entry{}
)

// Register makes a backend available under its Name. It is called from the
// init function of the backend's package; registering one name twice is a
// programmer error and panics, like sql.Register.
func Register(b Backend) {
	if b == nil {
		panic("transport: Register of a nil backend")
	}
	register(b.Name(), entry{backend: b})
}

// RegisterOpen registers the backend name whose Open is open, the
// backend package's own constructor. Where open fails, the backend's Open
// returns a nil Transport, never a nil *T inside a non-nil interface.
func RegisterOpen[T Transport](name string, open func(context.Context, Options) (T, error)) {
	Register(opener[T]{name: name, open: open})
}

// opener is a Backend made of a name and a constructor.
type opener[T Transport] struct {
	name string
	open func(context.Context, Options) (T, error)
}

func (b opener[T]) Name() string { return b.name }

func (b opener[T]) Open(ctx context.Context, opts Options) (Transport, error) {
	t, err := b.open(ctx, opts)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// RegisterUnavailable records a backend that this binary names but cannot
// use, with the reason (wrapping ErrNotBuilt).
func RegisterUnavailable(name string, why error) {
	if why == nil {
		panic("transport: RegisterUnavailable without a reason")
	}
	register(name, entry{err: why})
}

func register(name string, e entry) {
	name = strings.ToLower(name)
	mu.Lock()
	defer mu.Unlock()
	// Build tags make a backend's real and unavailable registrations
	// exclusive (ucx vs ucx_off.go, shm on Linux vs elsewhere).
	if _, dup := registry[name]; dup {
		panic(fmt.Sprintf("transport: backend %q registered twice", name))
	}
	registry[name] = e
}

// Lookup returns the status of the named backend (any case).
func Lookup(name string) (Status, error) {
	mu.RLock()
	defer mu.RUnlock()
	e, ok := registry[strings.ToLower(name)]
	if !ok {
		return Status{}, fmt.Errorf("%w %q", ErrUnknownBackend, name)
	}
	return Status{Name: strings.ToLower(name), Err: e.err}, nil
}

// Get returns the named backend, or an error saying why it cannot be used.
func Get(name string) (Backend, error) {
	mu.RLock()
	defer mu.RUnlock()
	e, ok := registry[strings.ToLower(name)]
	switch {
	case !ok:
		return nil, fmt.Errorf("%w %q", ErrUnknownBackend, name)
	case e.err != nil:
		return nil, fmt.Errorf("transport: backend %s: %w", strings.ToLower(name), e.err)
	}
	return e.backend, nil
}

// Open opens the named backend's data plane (see Backend.Open).
func Open(ctx context.Context, name string, opts Options) (Transport, error) {
	b, err := Get(name)
	if err != nil {
		return nil, err
	}
	return b.Open(ctx, opts.WithDefaults())
}

// All returns every registered backend, sorted by name.
func All() []Status {
	mu.RLock()
	defer mu.RUnlock()
	out := make([]Status, 0, len(registry))
	for name, e := range registry {
		out = append(out, Status{Name: name, Err: e.err})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
