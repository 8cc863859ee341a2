//go:build linux

package hugepage

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"unsafe"
)

// thpEnabled reports the kernel's transparent huge page mode ("always",
// "madvise", "never"), or "" when the kernel has none.
func thpEnabled() string {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.IndexByte(s, '['); i >= 0 {
		if j := strings.IndexByte(s[i:], ']'); j > 0 {
			return s[i+1 : i+j]
		}
	}
	return ""
}

// TestAdvise advises a written anonymous mapping: the contents are kept,
// the interior is reported, and where MADV_COLLAPSE succeeded the kernel
// backs the whole interior with huge pages.
func TestAdvise(t *testing.T) {
	const n = 6*Size + 12345
	mem, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	defer syscall.Munmap(mem)
	// Its own flags, so that the kernel does not merge it with a
	// neighbouring mapping (Backed counts mappings wholly inside it).
	if err := syscall.Madvise(mem, syscall.MADV_NOHUGEPAGE); err != nil {
		t.Fatal(err)
	}
	// Advise a slice that starts off a page boundary, so that the
	// interior is not the whole mapping.
	region := mem[4096:]
	for i := range region {
		region[i] = byte(i*7 + i>>13)
	}
	want := bytes.Clone(region)
	rep, err := Advise(region)
	if thpEnabled() == "" || thpEnabled() == "never" {
		if err == nil {
			t.Logf("THP mode %q, yet MADV_HUGEPAGE was accepted", thpEnabled())
		}
		t.Skipf("no transparent huge pages here (mode %q): %v", thpEnabled(), err)
	}
	if err != nil {
		t.Fatalf("Advise: %v", err)
	}
	start, length, _ := Interior(uintptr(unsafe.Pointer(&region[0])), uintptr(len(region)))
	if rep.Bytes != length || length < 4*Size {
		t.Fatalf("Advise reported %d bytes, want the interior's %d", rep.Bytes, length)
	}
	if !bytes.Equal(region, want) {
		t.Fatal("Advise changed the contents")
	}
	if rep.Collapse != nil {
		if !errors.Is(rep.Collapse, syscall.EINVAL) {
			t.Logf("MADV_COLLAPSE: %v", rep.Collapse)
		}
		t.Skipf("the kernel did not collapse (%v): the pages present stay small", rep.Collapse)
	}
	got, err := Backed(mem)
	if err != nil {
		t.Skipf("cannot read the backing: %v", err)
	}
	if got != int64(length) {
		t.Fatalf("after MADV_COLLAPSE the mapping has %d bytes of huge pages, want the interior's %d (from %#x)", got, length, start)
	}
}

func TestAdviseSmallAndEmpty(t *testing.T) {
	for _, n := range []int{0, 1, Size - 1} {
		mem := make([]byte, n)
		for i := range mem {
			mem[i] = byte(i)
		}
		rep, err := Advise(mem)
		if err != nil || rep != (Report{}) {
			t.Fatalf("Advise(%d bytes) = %+v, %v; want nothing advised", n, rep, err)
		}
		for i := range mem {
			if mem[i] != byte(i) {
				t.Fatalf("Advise(%d bytes) changed byte %d", n, i)
			}
		}
	}
}

// recorder is a slog handler that keeps every record's level and message.
type recorder struct{ recs *[]string }

func (r recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r recorder) Handle(_ context.Context, rec slog.Record) error {
	*r.recs = append(*r.recs, rec.Level.String()+" "+rec.Message)
	return nil
}
func (r recorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r recorder) WithGroup(string) slog.Handler      { return r }

// TestAdviseLogged: a region with whole huge pages in it is advised and
// says so at Debug (or, where the kernel refuses, at Info the first time
// only); a region too small for one says nothing.
func TestAdviseLogged(t *testing.T) {
	var recs []string
	log := slog.New(recorder{&recs})
	var logged atomic.Bool
	mem, err := syscall.Mmap(-1, 0, 3*Size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	defer syscall.Munmap(mem)
	AdviseLogged(mem[:Size/2], log, "xfer", ", which costs", &logged)
	if len(recs) != 0 {
		t.Fatalf("a region with no whole huge page logged %q", recs)
	}
	AdviseLogged(mem, log, "xfer", ", which costs", &logged)
	AdviseLogged(mem, log, "xfer", ", which costs", &logged)
	refused := 0
	for _, r := range recs {
		switch {
		case r == "INFO xfer: registered memory stays in small pages, which costs":
			refused++
		case strings.HasPrefix(r, "DEBUG xfer: registered memory"):
		default:
			t.Errorf("unexpected record %q", r)
		}
	}
	if refused > 1 || refused == 0 && len(recs) != 2 || refused == 1 != logged.Load() {
		t.Fatalf("records %q (logged %v): want one Debug record per call, or one Info refusal in all", recs, logged.Load())
	}
}
