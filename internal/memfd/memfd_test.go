package memfd

import (
	"errors"
	"runtime"
	"testing"
)

func TestNilMapping(t *testing.T) {
	var m *Mapping
	if m.Bytes() != nil || m.File() != nil || m.Size() != 0 || m.Close() != nil {
		t.Error("a nil Mapping is not empty and closed")
	}
}

func TestUnsupported(t *testing.T) {
	if runtime.GOOS == "linux" {
		t.Skip("memory files exist on Linux")
	}
	if _, err := New("memfd-test", 4096, Options{}); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("New on %s = %v, want ErrUnsupported", runtime.GOOS, err)
	}
	if _, err := MapReadOnly(nil, 4096); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("MapReadOnly on %s = %v, want ErrUnsupported", runtime.GOOS, err)
	}
}
