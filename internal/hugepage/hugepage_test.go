package hugepage

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestInterior(t *testing.T) {
	const H = Size
	for _, c := range []struct {
		name          string
		addr, n       uintptr
		start, length uintptr
		ok            bool
	}{
		{"aligned", 4 * H, 3 * H, 4 * H, 3 * H, true},
		{"unaligned both ends", 4*H + 8192, 3 * H, 5 * H, 2 * H, true},
		{"unaligned end", 4 * H, 2*H + 1, 4 * H, 2 * H, true},
		{"unaligned start", 4*H - 1, 2 * H, 4 * H, H, true},
		{"one page exactly", H, H, H, H, true},
		{"straddles a boundary", H + 4096, H, 0, 0, false},
		{"smaller than a page", 0, H - 1, 0, 0, false},
		{"empty", 8 * H, 0, 0, 0, false},
		{"wraps", math.MaxUint - H, 2 * H, 0, 0, false},
		{"rounding up wraps", math.MaxUint - 100, 50, 0, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, l, ok := Interior(c.addr, c.n)
			if s != c.start || l != c.length || ok != c.ok {
				t.Fatalf("Interior(%#x, %#x) = %#x, %#x, %v; want %#x, %#x, %v", c.addr, c.n, s, l, ok, c.start, c.length, c.ok)
			}
		})
	}
}

// TestInteriorProperty checks Interior against a naive reference: a walk
// over every huge page near the region, keeping those wholly inside it.
func TestInteriorProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 2))
	const H = Size
	for range 20000 {
		addr := uintptr(rng.Uint64N(64 * H))
		if rng.IntN(2) == 0 {
			addr &^= 4095
		}
		n := uintptr(rng.Uint64N(8 * H))
		var first, count uintptr
		for p := addr / H * H; p < addr+n+H; p += H {
			if p >= addr && p+H <= addr+n {
				if count == 0 {
					first = p
				}
				count++
			}
		}
		s, l, ok := Interior(addr, n)
		if ok != (count > 0) || (ok && (s != first || l != count*H)) {
			t.Fatalf("Interior(%#x, %#x) = %#x, %#x, %v; naive: %d pages from %#x", addr, n, s, l, ok, count, first)
		}
		if ok && (s < addr || s+l > addr+n || s%H != 0 || l%H != 0) {
			t.Fatalf("Interior(%#x, %#x) = %#x, %#x: outside the region or unaligned", addr, n, s, l)
		}
	}
}

func FuzzInterior(f *testing.F) {
	f.Add(uint64(4*Size+8192), uint64(3*Size))
	f.Add(uint64(math.MaxUint64-100), uint64(50))
	f.Fuzz(func(t *testing.T, a, n uint64) {
		addr, size := uintptr(a), uintptr(n)
		s, l, ok := Interior(addr, size)
		if !ok {
			if s != 0 || l != 0 {
				t.Fatalf("Interior(%#x, %#x) = %#x, %#x, false: want zeros", addr, size, s, l)
			}
			return
		}
		if addr+size < addr || s < addr || s+l < s || s+l > addr+size || s%Size != 0 || l%Size != 0 || l == 0 {
			t.Fatalf("Interior(%#x, %#x) = %#x, %#x: not whole aligned pages inside the region", addr, size, s, l)
		}
		// Maximal: no whole page fits before s or after s+l.
		if s-addr >= Size || addr+size-(s+l) >= Size {
			t.Fatalf("Interior(%#x, %#x) = %#x, %#x: a whole page is left out", addr, size, s, l)
		}
	})
}
