package ucx

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestHugeInterior(t *testing.T) {
	const H = hugePage
	for _, c := range []struct {
		name          string
		addr, n       uintptr
		start, length uintptr
		ok            bool
	}{
		{"aligned", 4 * H, 3 * H, 4 * H, 3 * H, true},
		{"unaligned both ends", 4*H + 8192, 3 * H, 5 * H, 2 * H, true},
		{"unaligned end", 4 * H, 2*H + 1, 4 * H, 2 * H, true},
		{"one page exactly", H, H, H, H, true},
		{"straddles a boundary", H + 4096, H, 0, 0, false},
		{"smaller than a page", 0, H - 1, 0, 0, false},
		{"empty", 8 * H, 0, 0, 0, false},
		{"wraps", math.MaxUint - H, 2 * H, 0, 0, false},
		{"rounding up wraps", math.MaxUint - 100, 50, 0, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, l, ok := hugeInterior(c.addr, c.n)
			if s != c.start || l != c.length || ok != c.ok {
				t.Fatalf("hugeInterior(%#x, %#x) = %#x, %#x, %v; want %#x, %#x, %v", c.addr, c.n, s, l, ok, c.start, c.length, c.ok)
			}
		})
	}
}

// TestHugeInteriorProperty checks hugeInterior against a naive walk over
// the huge pages near the region: the result is exactly the union of the
// aligned pages that lie wholly inside it.
func TestHugeInteriorProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const H = hugePage
	for range 20000 {
		addr := uintptr(rng.Uint64N(64*H)) &^ 4095
		n := uintptr(rng.Uint64N(8 * H))
		if rng.IntN(4) == 0 {
			n &^= 4095
		}
		var first, count uintptr
		for p := addr / H * H; p < addr+n+H; p += H {
			if p >= addr && p+H <= addr+n {
				if count == 0 {
					first = p
				}
				count++
			}
		}
		s, l, ok := hugeInterior(addr, n)
		if ok != (count > 0) || (ok && (s != first || l != count*H)) {
			t.Fatalf("hugeInterior(%#x, %#x) = %#x, %#x, %v; naive: %d pages from %#x", addr, n, s, l, ok, count, first)
		}
		if ok && (s < addr || s+l > addr+n || s%H != 0 || l%H != 0) {
			t.Fatalf("hugeInterior(%#x, %#x) = %#x, %#x: outside the region or unaligned", addr, n, s, l)
		}
	}
}
