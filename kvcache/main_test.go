package kvcache

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testLayout is a tiny block: 1 layer × 2 (K, V) × 1 head × 4 tokens × 2
// elements × 2 bytes = 32 bytes.
var testLayout = BlockLayout{Layers: 1, KVFactor: 2, Heads: 1, TokensPerBlock: 4, HeadDim: 2, ElemSize: 2}

func newTestPool(t testing.TB, numBlocks int) *Pool {
	t.Helper()
	p, err := NewPool(testLayout, numBlocks, nil)
	if err != nil {
		t.Fatalf("NewPool: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// checkConsistent fails t if the pool's internal structures disagree.
func checkConsistent(t testing.TB, p *Pool) {
	t.Helper()
	p.mu.Lock()
	err := p.consistencyLocked()
	p.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
}

// skipMisuse skips tests that provoke misuse errors, which panic under the
// invariants tag (invariants_test.go covers that build).
func skipMisuse(t *testing.T) {
	t.Helper()
	if invariants {
		t.Skip("misuse panics under the invariants tag")
	}
}

func hashN(i int) Hash { return BlockHash(Hash{}, []int32{int32(i)}) }
