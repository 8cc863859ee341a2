package memcopy

import (
	"testing"

	"golang.org/x/sys/cpu"
)

// TestDefaultLoop checks that StreamSpan runs the AVX loop wherever the
// processor has AVX, and says so when this one has not (only the SSE2
// loop is then tested).
func TestDefaultLoop(t *testing.T) {
	if useAVX != cpu.X86.HasAVX {
		t.Fatalf("useAVX = %v on a processor whose HasAVX is %v", useAVX, cpu.X86.HasAVX)
	}
	if !cpu.X86.HasAVX {
		t.Skip("no AVX on this processor: the AVX loop is not tested here")
	}
}
