package mover

import (
	"context"
	"sync"
)

// QueueChunks is how many chunk announcements a staged send's queue holds
// (Attempts.Announce): more than any receiver keeps in flight, so a queue
// that is full means a peer that announces more than it may.
const QueueChunks = 64

// Attempts is what the sends of a context request's pull attempts share:
// for each attempt, a context that stops its sends (a child of the
// request's), and, for each of its staged sends, the queue of chunk
// announcements a staged send reads (Pair.Send). An attempt's state is made
// on first use and lives as long as the Attempts; a request has a handful
// of attempts at most. Safe for concurrent use.
type Attempts struct {
	parent context.Context
	mu     sync.Mutex
	m      map[uint64]*attempt
}

type attempt struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	queues map[int]chan Chunk // by generation rank
}

// NewAttempts returns the attempts of a request whose sends all stop when
// parent ends.
func NewAttempts(parent context.Context) *Attempts {
	return &Attempts{parent: parent, m: map[uint64]*attempt{}}
}

// get returns attempt a, made on first use. Called with s.mu held.
func (s *Attempts) get(a uint64) *attempt {
	at := s.m[a]
	if at == nil {
		ctx, cancel := context.WithCancelCause(s.parent)
		at = &attempt{ctx: ctx, cancel: cancel, queues: map[int]chan Chunk{}}
		s.m[a] = at
	}
	return at
}

// Start returns what attempt a's send to generation rank gen reads: the
// attempt's context and, for a staged send (staged), its queue of chunk
// announcements (nil for a direct send, which takes none).
func (s *Attempts) Start(a uint64, gen int, staged bool) (context.Context, <-chan Chunk) {
	s.mu.Lock()
	defer s.mu.Unlock()
	at := s.get(a)
	if !staged {
		return at.ctx, nil
	}
	return at.ctx, at.queue(gen)
}

// Announce queues chunk announcement c for attempt a's staged send to
// generation rank gen, which may not have started yet. It reports false,
// queueing nothing, when the queue is full: the peer announced more than
// it may.
func (s *Attempts) Announce(a uint64, gen int, c Chunk) bool {
	s.mu.Lock()
	q := s.get(a).queue(gen)
	s.mu.Unlock()
	select {
	case q <- c:
		return true
	default:
		return false
	}
}

// queue returns the queue of chunk announcements to generation rank gen
// (QueueChunks long), made on first use. Called with Attempts.mu held.
func (at *attempt) queue(gen int) chan Chunk {
	q := at.queues[gen]
	if q == nil {
		q = make(chan Chunk, QueueChunks)
		at.queues[gen] = q
	}
	return q
}

// Stop stops attempt a's sends: their context ends with cause. Its
// queues stay, so that late announcements find one (and are never read).
func (s *Attempts) Stop(a uint64, cause error) {
	s.mu.Lock()
	at := s.get(a)
	s.mu.Unlock()
	at.cancel(cause)
}
