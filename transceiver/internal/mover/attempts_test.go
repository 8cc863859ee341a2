package mover

import (
	"context"
	"errors"
	"sync"
	"testing"
)

// TestAttempts checks what the sends of a request's attempts share: one
// context per attempt, stopped alone by Stop with its cause and all
// together by the request's; one queue per attempt and generation rank,
// the same whoever asks first.
func TestAttempts(t *testing.T) {
	parent, cancel := context.WithCancelCause(context.Background())
	s := NewAttempts(parent)
	q := s.Queue(1, 0) // an announcement before the send starts
	if got := s.Queue(1, 0); got != q {
		t.Fatal("Queue(1, 0) twice: two queues")
	}
	if cap(q) != QueueChunks {
		t.Fatalf("queue holds %d, want %d", cap(q), QueueChunks)
	}
	if s.Queue(1, 1) == q || s.Queue(2, 0) == q {
		t.Fatal("another generation rank or attempt shares attempt 1's queue to rank 0")
	}
	c1, c2 := s.Context(1), s.Context(2)
	if s.Context(1) != c1 {
		t.Fatal("Context(1) twice: two contexts")
	}
	gaveUp := errors.New("attempt 1 given up")
	s.Stop(1, gaveUp)
	if !errors.Is(context.Cause(c1), gaveUp) {
		t.Fatalf("attempt 1 after Stop: cause %v, want %v", context.Cause(c1), gaveUp)
	}
	if c2.Err() != nil {
		t.Fatalf("attempt 2 stopped with attempt 1: %v", c2.Err())
	}
	if s.Queue(1, 0) != q {
		t.Fatal("a stopped attempt's queue was replaced")
	}
	s.Stop(3, gaveUp) // an attempt never used: stopped before its sends start
	if s.Context(3).Err() == nil {
		t.Fatal("attempt 3 stopped before use: its context is live")
	}
	ended := errors.New("request ended")
	cancel(ended)
	if !errors.Is(context.Cause(c2), ended) || !errors.Is(context.Cause(s.Context(4)), ended) {
		t.Fatalf("after the request's end: attempt 2 %v, a new attempt %v; want %v", context.Cause(c2), context.Cause(s.Context(4)), ended)
	}
}

// TestAttemptsConcurrent: every caller of one attempt and rank gets the
// same queue and context (run with -race).
func TestAttemptsConcurrent(t *testing.T) {
	s := NewAttempts(context.Background())
	const callers = 8
	queues := make([]chan Chunk, callers)
	ctxs := make([]context.Context, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			if i%2 == 0 {
				queues[i], ctxs[i] = s.Queue(7, 3), s.Context(7)
			} else {
				ctxs[i], queues[i] = s.Context(7), s.Queue(7, 3)
			}
		})
	}
	wg.Wait()
	for i := 1; i < callers; i++ {
		if queues[i] != queues[0] || ctxs[i] != ctxs[0] {
			t.Fatalf("caller %d got another queue or context than caller 0", i)
		}
	}
}
