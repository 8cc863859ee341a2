package workers

import (
	"sync"
	"sync/atomic"
)

// Pool runs jobs on goroutines it keeps: a job goes to an idle worker when
// there is one, else to a new goroutine; a worker whose job is done waits
// for the next one, up to maxIdle of them (one more ends).
//
// Go may be called from any goroutine, jobs included. Close ends the idle
// workers and waits for every job; it is idempotent. A job handed to Go
// during or after Close still runs, on a goroutine of its own, and Close
// (or a later Close) waits for it only if it was handed before Close
// returned (like a sync.WaitGroup's Add racing its Wait, the caller must
// not start work after it has decided to stop).
type Pool struct {
	maxIdle int32
	jobs    chan func()
	idle    atomic.Int32
	wg      sync.WaitGroup
	stop    chan struct{}
	once    sync.Once
}

// NewPool returns a pool that keeps up to maxIdle idle workers. It starts
// no goroutine.
func NewPool(maxIdle int) *Pool {
	return &Pool{maxIdle: int32(max(maxIdle, 0)), jobs: make(chan func()), stop: make(chan struct{})}
}

// Go runs job on a worker goroutine.
func (p *Pool) Go(job func()) {
	select {
	case p.jobs <- job:
		return
	default:
	}
	p.wg.Add(1)
	go p.work(job)
}

func (p *Pool) work(job func()) {
	defer p.wg.Done()
	for {
		job()
		if p.idle.Add(1) > p.maxIdle {
			p.idle.Add(-1)
			return
		}
		select {
		case job = <-p.jobs:
			p.idle.Add(-1)
		case <-p.stop:
			p.idle.Add(-1)
			return
		}
	}
}

// Idle returns the number of workers waiting for a job.
func (p *Pool) Idle() int { return int(p.idle.Load()) }

// Close ends the idle workers and waits for the jobs that run.
func (p *Pool) Close() {
	p.once.Do(func() { close(p.stop) })
	p.wg.Wait()
}

// Group counts what may still touch a resource: a sync.WaitGroup whose
// waiter is a function, run by the Done that brings the count to zero,
// rather than a goroutine parked in Wait. The zero value is ready.
type Group struct {
	mu   sync.Mutex
	n    int
	then func() // run by the Done that brings n to 0; nil: none
}

// Add adds n to the count.
func (g *Group) Add(n int) {
	g.mu.Lock()
	g.n += n
	g.mu.Unlock()
}

// Done ends one member; the last one runs the function Then left, on its
// own goroutine, after the group's lock is released. Done without a
// matching Add panics.
func (g *Group) Done() {
	g.mu.Lock()
	g.n--
	if g.n < 0 {
		g.mu.Unlock()
		panic("workers: Group.Done without Add")
	}
	var f func()
	if g.n == 0 {
		f, g.then = g.then, nil
	}
	g.mu.Unlock()
	if f != nil {
		f()
	}
}

// Then has f run once no member is left, replacing a function left
// before. The caller must be a member, so f runs at the latest on the
// caller's own Done, never inside Then; Then from outside the group
// panics.
func (g *Group) Then(f func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n <= 0 {
		panic("workers: Group.Then outside a member")
	}
	g.then = f
}
