package transceiver

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
)

// Ranks in several processes.
//
// A Transceiver may host only some ranks of its instance (Options.Ranks),
// as the engines do that run one process per GPU rank. The processes of an
// instance then form a Group. They join it once, in New or in the first
// round of a GatherGroup: each contributes its ranks, their control
// endpoints and 32 random bytes; every process learns every rank's
// endpoint (the opaque state lists them all) and the instance secret, the
// SHA-256 of the contributions in process order. From the instance secret
// and the caller's ids each process derives, with no message per request,
// what must be the same on every rank: a context request's transfer token
// and a generation request's pull id (see deriveToken, derivePullID).
//
// Every process keeps a copy of the consensus core (consensus.go) and feeds
// it the same totally ordered log of the ranks' reports: a process
// publishes its ranks' events to the group and applies the log as the group
// delivers it, carrying out the effects for its own ranks and completing
// its own Requests. The log is ordered by the coordinator
// (CoordinatedGroup) or by the rounds of an all-gather the caller runs,
// each round's contributions applied in process order (GatherGroup). A
// process that leaves the group (its connection to the coordinator breaks,
// or a round fails) fails every request in flight on its ranks, on every
// process, at once: its ranks count as having failed (ranksLostEvent). A
// process that loses the group (the coordinator died, the caller called
// Fail) fails every request in flight with ErrGroupLost and refuses new
// ones. A request that fails (or is cancelled) before some process has
// begun it is ended for that process's ranks by that process, when it
// applies the cancel, so that no process keeps it in flight waiting for a
// rank that was never handed it; that process refuses to begin it for
// kv_transfer_timeout afterwards (ErrCanceled, saying it already ended).

// Errors of a group.
var (
	// ErrGroupLost: the process lost the instance's group (the coordinator
	// died, a round of the all-gather failed, a process left).
	ErrGroupLost = errors.New("transceiver: instance group lost")
	// ErrNotJoined: the group has not finished its join yet (a GatherGroup
	// needs a first round).
	ErrNotJoined = errors.New("transceiver: the instance group has not joined yet")
	// ErrBadGroup: the joins of the processes do not make the instance
	// (ranks missing, twice, or out of range).
	ErrBadGroup = errors.New("transceiver: bad instance group")
)

// Group is how the processes hosting the ranks of one instance agree on its
// requests: *CoordinatedGroup (over TCP, the process of rank 0
// coordinating) or *GatherGroup (through an all-gather the caller runs).
// A Group serves one Transceiver (Options.Group) and is closed by its
// Close.
type Group interface {
	// start joins the group for m, whose contribution is self. It returns
	// once the join is done, or (a GatherGroup driven by its caller) once
	// it is under way; m.joined is called when it is done.
	start(ctx context.Context, m groupMember, self groupJoin) error
	// publish appends this process's events to the log; it never blocks
	// on the network and never calls m back on the caller's goroutine.
	publish(evs ...instEvent)
	// leave stops taking part: the other processes see this one leave;
	// events published afterwards are applied here only. Idempotent.
	leave(err error)
	// close stops the group's goroutines, once every event published has
	// been applied here. Idempotent.
	close() error
}

// groupMember is what a Group drives: the Transceiver of its process.
type groupMember interface {
	// joined receives the joins of every process, in process order, once.
	joined(all []groupJoin) error
	// apply receives a piece of the log. The group calls it from one
	// goroutine at a time, in log order.
	apply(evs []instEvent)
	// lost says that this process has lost the group, with err: it
	// refuses new requests from now on. It returns the event that fails
	// every other process's ranks, for the group to apply after what this
	// process published and the others may not have seen.
	lost(err error) instEvent
}

// groupInfo is what a process knows once the group has joined.
type groupInfo struct {
	endpoints []string // every rank's control endpoint
	owner     []int    // the process hosting each rank
	secret    [32]byte // the instance secret
}

// joinGroup checks that the joins make an instance of nranks ranks, and
// derives what the processes share.
func joinGroup(all []groupJoin, nranks int) (*groupInfo, error) {
	info := &groupInfo{endpoints: make([]string, nranks), owner: make([]int, nranks)}
	for i := range info.owner {
		info.owner[i] = -1
	}
	h := sha256.New()
	h.Write([]byte("kvxfer/v1/instance-secret"))
	for p, j := range all {
		if len(j.ranks) == 0 || len(j.ranks) != len(j.endpoints) {
			return nil, fmt.Errorf("%w: process %d joined with %d ranks and %d endpoints", ErrBadGroup, p, len(j.ranks), len(j.endpoints))
		}
		for i, r := range j.ranks {
			if r < 0 || r >= nranks {
				return nil, fmt.Errorf("%w: process %d hosts rank %d, the instance has ranks 0..%d", ErrBadGroup, p, r, nranks-1)
			}
			if info.owner[r] >= 0 {
				return nil, fmt.Errorf("%w: rank %d is hosted by processes %d and %d", ErrBadGroup, r, info.owner[r], p)
			}
			info.owner[r], info.endpoints[r] = p, j.endpoints[i]
		}
		h.Write(j.share[:])
	}
	for r, p := range info.owner {
		if p < 0 {
			return nil, fmt.Errorf("%w: no process hosts rank %d (%d processes joined)", ErrBadGroup, r, len(all))
		}
	}
	copy(info.secret[:], h.Sum(nil))
	return info, nil
}

// deriveToken is the transfer token of context request id of an instance
// with secret: HMAC-SHA256 under the instance secret of the id and the
// request's prompt length, cut to 16 bytes. Every process of the instance
// computes the same, with no message. Holding the token of one request
// tells nothing of another's (HMAC is a pseudo-random function of its
// input), and the secret never leaves the instance's processes. An id the
// caller uses again gets the same token: the holder of the earlier
// request's opaque state could pull the later one while it is held, so
// the ids of an instance's requests must not repeat within its life (as
// TensorRT-LLM's executor's do not).
func deriveToken(secret [32]byte, id uint64, tokens uint64) [16]byte {
	m := hmac.New(sha256.New, secret[:])
	m.Write([]byte("kvxfer/v1/token"))
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], id)
	binary.LittleEndian.PutUint64(b[8:], tokens)
	m.Write(b[:])
	var tok [16]byte
	copy(tok[:], m.Sum(nil))
	return tok
}

// derivePullID is the pull id (wire GenRequestID) of generation request
// genID pulling the context request whose opaque state is opaque: the
// same on every process of the instance, never 0, different (but with
// probability 2^-64) for another generation request, another state or
// another instance. A generation request retried with the same id and
// the same state gets the same id, which the context side has seen fail:
// a retry uses a new generation request id.
func derivePullID(secret [32]byte, genID uint64, opaque []byte) uint64 {
	m := hmac.New(sha256.New, secret[:])
	m.Write([]byte("kvxfer/v1/pull"))
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], genID)
	m.Write(b[:])
	sum := sha256.Sum256(opaque)
	m.Write(sum[:])
	id := binary.LittleEndian.Uint64(m.Sum(nil))
	if id == 0 {
		id = 1
	}
	return id
}

// localEcho applies, on its own goroutine and in order, what a process
// publishes once it has left its group, so that its own ranks' reports
// still complete its requests.
type localEcho struct {
	mu      sync.Mutex
	queue   [][]instEvent
	wake    chan struct{}
	running bool
	wg      sync.WaitGroup
	stopped bool
}

// push queues evs for m; the first push starts the goroutine. After stop
// nothing is applied: the Transceiver has closed its ranks by then.
func (e *localEcho) push(m groupMember, evs []instEvent) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped {
		return
	}
	e.queue = append(e.queue, slices.Clone(evs))
	if e.wake == nil {
		e.wake = make(chan struct{}, 1)
	}
	select {
	case e.wake <- struct{}{}:
	default:
	}
	if !e.running {
		e.running = true
		e.wg.Add(1)
		go e.loop(m)
	}
}

func (e *localEcho) loop(m groupMember) {
	defer e.wg.Done()
	for {
		e.mu.Lock()
		if len(e.queue) == 0 {
			if e.stopped {
				e.running = false
				e.mu.Unlock()
				return
			}
			wake := e.wake
			e.mu.Unlock()
			<-wake
			continue
		}
		evs := e.queue[0]
		e.queue = e.queue[1:]
		e.mu.Unlock()
		m.apply(evs)
	}
}

// stop lets the goroutine finish what is queued and waits for it.
func (e *localEcho) stop() {
	e.mu.Lock()
	e.stopped = true
	if e.wake != nil {
		select {
		case e.wake <- struct{}{}:
		default:
		}
	}
	e.mu.Unlock()
	e.wg.Wait()
}
