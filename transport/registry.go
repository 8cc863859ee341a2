package transport

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
)

// ErrNotBuilt is wrapped by the availability error of a backend that exists
// in kvxfer but was left out of this binary by a build tag.
var ErrNotBuilt = errors.New("transport: not built in this binary")

// ErrNotImplemented is wrapped by the availability error of a backend that
// kvxfer names but does not implement yet.
var ErrNotImplemented = errors.New("transport: not implemented yet")

// ErrUnknownBackend is returned by Lookup for a name no backend uses.
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

var (
	mu       sync.RWMutex
	registry = map[string]Status{}
)

// Register records a backend's availability. It is called from init
// functions of backend files; a second registration of one name is a
// programmer error and panics, like sql.Register.
func Register(name string, availability error) {
	name = strings.ToLower(name)
	mu.Lock()
	defer mu.Unlock()
	if _, dup := registry[name]; dup {
		panic(fmt.Sprintf("transport: Register called twice for backend %q", name))
	}
	registry[name] = Status{Name: name, Err: availability}
}

// Lookup returns the status of the named backend (any case).
func Lookup(name string) (Status, error) {
	mu.RLock()
	defer mu.RUnlock()
	s, ok := registry[strings.ToLower(name)]
	if !ok {
		return Status{}, fmt.Errorf("%w %q", ErrUnknownBackend, name)
	}
	return s, nil
}

// All returns every registered backend, sorted by name.
func All() []Status {
	mu.RLock()
	defer mu.RUnlock()
	out := make([]Status, 0, len(registry))
	for _, s := range registry {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func init() {
	// The data planes land with the transceiver (tcp) and the shm/ucx issue.
	Register("tcp", fmt.Errorf("%w: the TCP data plane arrives with the transceiver", ErrNotImplemented))
	Register("shm", fmt.Errorf("%w: the shared-memory data plane arrives after the TCP one", ErrNotImplemented))
}
