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
// which takes announcements before its send starts, QueueChunks of them
// at most.
func TestAttempts(t *testing.T) {
	parent, cancel := context.WithCancelCause(context.Background())
	s := NewAttempts(parent)
	if !s.Announce(1, 0, Chunk{Index: 0}) { // an announcement before the send starts
		t.Fatal("the first announcement was refused")
	}
	if !s.Announce(1, 1, Chunk{Index: 7}) || !s.Announce(2, 0, Chunk{Index: 8}) {
		t.Fatal("an announcement to another generation rank or attempt was refused")
	}
	for i := 1; i < QueueChunks; i++ {
		if !s.Announce(1, 0, Chunk{Index: i}) {
			t.Fatalf("announcement %d of %d refused", i, QueueChunks)
		}
	}
	if s.Announce(1, 0, Chunk{Index: QueueChunks}) {
		t.Fatalf("announcement %d taken: the queue holds %d", QueueChunks+1, QueueChunks)
	}
	c1, q := s.Start(1, 0, true)
	for i := range QueueChunks {
		if c := <-q; c.Index != i {
			t.Fatalf("announcement %d read as %d: another attempt's or rank's, or out of order", i, c.Index)
		}
	}
	if len(q) != 0 {
		t.Fatalf("%d announcements left in attempt 1's queue to rank 0", len(q))
	}
	if again, q2 := s.Start(1, 0, true); again != c1 || q2 != q {
		t.Fatal("Start(1, 0) twice: two contexts or queues")
	}
	c2, direct := s.Start(2, 1, false)
	if direct != nil {
		t.Fatal("a direct send was given a queue")
	}
	gaveUp := errors.New("attempt 1 given up")
	s.Stop(1, gaveUp)
	if !errors.Is(context.Cause(c1), gaveUp) {
		t.Fatalf("attempt 1 after Stop: cause %v, want %v", context.Cause(c1), gaveUp)
	}
	if c2.Err() != nil {
		t.Fatalf("attempt 2 stopped with attempt 1: %v", c2.Err())
	}
	if !s.Announce(1, 0, Chunk{}) || len(q) != 1 {
		t.Fatal("a stopped attempt's queue was replaced, or took no late announcement")
	}
	s.Stop(3, gaveUp) // an attempt never used: stopped before its sends start
	if c3, _ := s.Start(3, 0, true); c3.Err() == nil {
		t.Fatal("attempt 3 stopped before use: its context is live")
	}
	ended := errors.New("request ended")
	cancel(ended)
	c4, _ := s.Start(4, 0, false)
	if !errors.Is(context.Cause(c2), ended) || !errors.Is(context.Cause(c4), ended) {
		t.Fatalf("after the request's end: attempt 2 %v, a new attempt %v; want %v", context.Cause(c2), context.Cause(c4), ended)
	}
}

// TestAttemptsConcurrent: every caller of one attempt and rank gets the
// same queue and context, and every announcement made concurrently with
// them lands in that queue (run with -race).
func TestAttemptsConcurrent(t *testing.T) {
	s := NewAttempts(context.Background())
	const callers = 8
	queues := make([]<-chan Chunk, callers)
	ctxs := make([]context.Context, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			if i%2 == 0 {
				ctxs[i], queues[i] = s.Start(7, 3, true)
			} else if !s.Announce(7, 3, Chunk{Index: i}) {
				t.Errorf("announcement %d refused", i)
			}
		})
	}
	wg.Wait()
	for i := 2; i < callers; i += 2 {
		if queues[i] != queues[0] || ctxs[i] != ctxs[0] {
			t.Fatalf("caller %d got another queue or context than caller 0", i)
		}
	}
	if n := len(queues[0]); n != callers/2 {
		t.Fatalf("%d announcements in the queue, want %d", n, callers/2)
	}
}
