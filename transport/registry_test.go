package transport

import (
	"context"
	"errors"
	"testing"
)

var (
	errNoDevice        = errors.New("no such device")
	registryTestOpened Options // what the registry test's constructor was given
)

// nilTransport is a Transport type whose constructor fails with a nil
// *nilTransport, as a backend's Open does.
type nilTransport struct{ Transport }

// TestRegisterOpen: a backend registered with RegisterOpen is found under
// its name, in lower case, and opens with its constructor; a failed open
// yields a nil Transport, not a nil pointer in a non-nil interface.
func TestRegisterOpen(t *testing.T) {
	if _, err := Get("registry-test"); err != nil { // once per test binary (-count)
		RegisterOpen("Registry-Test", func(_ context.Context, o Options) (*nilTransport, error) {
			registryTestOpened = o
			return nil, errNoDevice
		})
	}
	tr, err := Open(context.Background(), "registry-test", Options{Streams: 3})
	opened := registryTestOpened
	if !errors.Is(err, errNoDevice) || tr != nil {
		t.Fatalf("Open of a failing backend: %v, %#v; want its error and a nil Transport", err, tr)
	}
	if opened.Streams != 3 {
		t.Errorf("the constructor got %d streams, want 3 (the caller's options, defaults filled)", opened.Streams)
	}
	b, err := Get("registry-test")
	if err != nil || b.Name() != "Registry-Test" {
		t.Errorf("Get: %v, %v; want the backend named as registered", b, err)
	}
}
