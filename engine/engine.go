package engine

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
)

// Defaults of Options.
const (
	DefaultMaxBatch         = 64
	DefaultMaxQueue         = 1024
	DefaultMaxPrefillTokens = 4096
	DefaultMaxTokens        = 16
	// DefaultReleaseUnpulledAfter is Options.ReleaseUnpulledAfter's
	// default.
	DefaultReleaseUnpulledAfter = 2 * time.Second
	// MaxStopStrings bounds Request.Stop (OpenAI allows 4).
	MaxStopStrings = 16
	// MaxStopLen bounds the length of one stop string, in bytes.
	MaxStopLen = 1024
	// pollInterval bounds an idle wait that cannot block on one event
	// source alone (see Engine.idle).
	pollInterval = 2 * time.Millisecond
	// unpulledRecheck is how often the scheduler, with requests waiting
	// for blocks, looks again at held requests that were due for release
	// but being pulled (Options.ReleaseUnpulledAfter).
	unpulledRecheck = 100 * time.Millisecond
)

// Options configure an Engine.
type Options struct {
	// Transceiver moves KV caches for context_only and generation_only
	// requests. It must have been built on the instance's State() and
	// Pools(). The engine takes it over: Close closes it. Nil means an
	// aggregated engine: disaggregated requests are refused.
	Transceiver *transceiver.Transceiver
	// MaxBatch bounds the requests holding blocks at once (prefilling,
	// transferring or decoding); default 64.
	MaxBatch int
	// MaxQueue bounds the requests waiting for admission; Submit returns
	// ErrQueueFull beyond it. Default 1024.
	MaxQueue int
	// MaxPrefillTokens bounds the prompt tokens prefilled in one iteration
	// (a longer prompt runs alone), so that decoding requests are not
	// starved; default 4096. With block reuse a prompt's cached prefix
	// does not count: only the tokens computed do.
	MaxPrefillTokens int
	// DefaultMaxTokens applies to requests with MaxTokens 0; default 16.
	DefaultMaxTokens int
	// ReleaseUnpulledAfter frees the blocks of context requests nobody has
	// come for when other requests need them: while a request waits for
	// blocks that held context_only requests keep, the oldest held request
	// that no generation instance is pulling
	// (transceiver.Transceiver.Pulling: a pull stuck past the staging hold
	// limit counts as none) and that has been held this long is released,
	// one at a time (a pull of it that comes later is refused as for an
	// unknown request). Without it, any client of the context worker could
	// hold the pool with context_only requests it never pulls, each for
	// kv_transfer_timeout_ms. Default DefaultReleaseUnpulledAfter;
	// negative: held requests are kept until their deadline.
	ReleaseUnpulledAfter time.Duration
	// Logger receives the engine's logs; nil discards them.
	Logger *slog.Logger
	// Now is the clock of the timings; nil means time.Now.
	Now func() time.Time

	// BlockReuse publishes every full block of a request's KV cache in the
	// pools' reuse index (kv_cache_config.enable_block_reuse): the prompt's
	// after its prefill (or its transfer), the generated tokens' when the
	// request ends. A new request then reuses the longest cached prefix of
	// its prompt and computes, or receives, only the rest. Off by default
	// here (the worker sets it from the config, whose default is on).
	BlockReuse bool
	// PartialReuse also reuses a cached block whose first tokens match the
	// prompt's next ones (kv_cache_config.enable_partial_reuse), and
	// computes the prompt from the first token that differs.
	PartialReuse bool
	// CopyOnPartialReuse (kv_cache_config.copy_on_partial_reuse) makes
	// partial reuse copy the matched block into a block of the request's
	// own, so that blocks other requests hold can be reused too. Without
	// it, partial reuse takes only a block nobody holds, out of the reuse
	// index, and writes it in place.
	CopyOnPartialReuse bool
	// EventBufferMaxSize bounds the KV cache events KVEvents can return
	// (kv_cache_config.event_buffer_max_size); 0 keeps none.
	EventBufferMaxSize int
}

// Engine is the executor of one instance: it admits requests while the KV
// pool has room, prefills them, hands context_only requests to the
// transceiver, pulls generation_only requests' KV caches, and decodes every
// running request one token per iteration, all of them in one batched
// forward pass (continuous batching). One
// scheduler goroutine does all of it; it is started by Start or by the
// first Submit, and stopped by Close.
//
// Submit and the accessors are safe for concurrent use.
type Engine struct {
	inst *Instance
	tr   *transceiver.Transceiver
	opts Options
	log  *slog.Logger
	rl   *netlimit.RateLog // per-request warnings: one line per cause per second
	now  func() time.Time

	life   context.Context // cancelled by Close
	stop   context.CancelFunc
	done   chan struct{} // closed when the scheduler exits
	nextID atomic.Uint64

	closeOnce sync.Once
	closeErr  error

	// mu guards the fields below. It is the engine's only lock and is never
	// held while calling the transceiver or the instance.
	mu         sync.Mutex
	started    bool
	closed     bool
	inbox      []*request
	kicked     bool               // something happened since the scheduler last looked
	waitCancel context.CancelFunc // interrupts the scheduler's idle wait
	stats      Stats
	held       map[uint64]*transceiver.Request // context_only requests the transceiver holds, by ctx_request_id
	heldAt     map[uint64]time.Time            // when each held request was handed over
	released   map[uint64]bool                 // held requests cancelled by CancelContext: their end is no failure
	unpulled   map[uint64]bool                 // held requests released for waiting requests (ReleaseUnpulledAfter), until they end
	unpulledN  uint64                          // such releases so far

	// Owned by the scheduler goroutine.
	waiting      []*request
	running      []*request
	transferring map[*transceiver.Request]*request
	draining     []*request // failed to start a transfer that some ranks had begun
	iterations   uint64
	prefilled    uint64 // tokens of the prefills that ran to the end
	stopped      uint64 // prefills stopped because their client went away
	// Scratch of a decode batch.
	batch     []*request
	batchSeqs []*Sequence
	batchToks []int32

	events *eventRing // KV cache events; safe for concurrent use
	// Reuse counters, owned by the scheduler.
	reuse struct {
		promptTokens uint64 // prompt tokens of the admitted requests
		cachedTokens uint64 // of which found in the cache
		published    uint64 // blocks rank 0 indexed anew
	}
}

// Stats is a snapshot of the engine's queues.
type Stats struct {
	Waiting      int    // submitted, not admitted yet
	Running      int    // decoding
	Transferring int    // generation_only requests pulling their KV
	FreeBlocks   int    // blocks every rank can allocate
	TotalBlocks  int    // blocks of each rank's pool
	Iterations   uint64 // scheduler iterations that did work
	// PrefillTokens counts the prompt tokens computed by the prefills that
	// ran to the end (not those found in the cache); PrefillsStopped the
	// prefills stopped part-way because their client went away (their
	// tokens are not counted).
	PrefillTokens   uint64
	PrefillsStopped uint64
	// Block reuse (Options.BlockReuse). PromptTokens counts the prompt
	// tokens of the requests admitted, CachedTokens those of them found in
	// the cache (prefix hits: neither computed nor received), so
	// CachedTokens/PromptTokens is the prefix hit rate. BlocksPublished
	// counts the blocks indexed for reuse, BlocksEvicted the cached blocks
	// evicted to make room (both rank 0's).
	PromptTokens    uint64
	CachedTokens    uint64
	BlocksPublished uint64
	BlocksEvicted   uint64
	// UnpulledReleased counts the held context requests released for
	// waiting requests before anyone pulled them (ReleaseUnpulledAfter).
	UnpulledReleased uint64
}

// request is the scheduler's record of one request.
type request struct {
	id        uint64
	ctx       context.Context
	stopAfter func() bool
	typ       transceiver.RequestType
	prompt    []int32 // the prompt and the resumed tokens: the KV cache's tokens before generation
	promptLen int     // the prompt's tokens alone
	maxTokens int
	temp      float64
	seed      uint64
	stopToks  []int32
	ignoreEOS bool
	phase     *transceiver.ContextPhaseParams // generation_only
	reserve   int                             // tokens of KV the request needs
	root      kvcache.Hash                    // the parent of the first block: RootHash(CacheSalt)
	hashes    []kvcache.Hash                  // block reuse: the chained hashes of the full blocks known so far
	published int                             // leading blocks already in the reuse index
	cached    int                             // prompt tokens found in the cache at admission

	out       *Stream
	text      *textStream
	seq       *Sequence
	treq      *transceiver.Request
	generated []int32
	state     transceiver.RequestState
	startErr  error // draining: why the transfer could not start
	cancelled bool  // transceiver.Cancel was called for the client
	finished  bool

	submitted, xferStart time.Time
	decodes              int
	timing               Timing
}

// New returns an engine running inst. It takes over inst and
// opts.Transceiver: Close closes both. It starts no goroutine.
func New(inst *Instance, opts Options) (*Engine, error) {
	if inst == nil {
		return nil, fmt.Errorf("%w: nil instance", ErrBadConfig)
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = DefaultMaxBatch
	}
	if opts.MaxQueue <= 0 {
		opts.MaxQueue = DefaultMaxQueue
	}
	if opts.MaxPrefillTokens <= 0 {
		opts.MaxPrefillTokens = DefaultMaxPrefillTokens
	}
	if opts.DefaultMaxTokens <= 0 {
		opts.DefaultMaxTokens = DefaultMaxTokens
	}
	if opts.ReleaseUnpulledAfter == 0 {
		opts.ReleaseUnpulledAfter = DefaultReleaseUnpulledAfter
	}
	e := &Engine{inst: inst, tr: opts.Transceiver, opts: opts, log: opts.Logger, now: opts.Now,
		done: make(chan struct{}), transferring: map[*transceiver.Request]*request{}, held: map[uint64]*transceiver.Request{},
		heldAt: map[uint64]time.Time{}, released: map[uint64]bool{}, unpulled: map[uint64]bool{}}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	e.rl = netlimit.NewRateLog(e.log, time.Second)
	if e.now == nil {
		e.now = time.Now
	}
	e.life, e.stop = context.WithCancel(context.Background())
	e.stats.TotalBlocks = inst.NumBlocks()
	e.stats.FreeBlocks = inst.FreeBlocks()
	e.events = newEventRing(opts.EventBufferMaxSize)
	if opts.EventBufferMaxSize > 0 {
		inst.pools[0].TrackEvictions(true)
		e.events.add(KVEvent{Type: KVEventCreated, NumBlocks: inst.NumBlocks()})
	}
	return e, nil
}

// Instance returns the engine's instance.
func (e *Engine) Instance() *Instance { return e.inst }

// State returns the instance's CacheState (for transceiver.Options).
func (e *Engine) State() layout.CacheState { return e.inst.State() }

// Pools returns the instance's pools in rank order (for
// transceiver.Options).
func (e *Engine) Pools() []*kvcache.Pool { return e.inst.Pools() }

// Stats returns a snapshot of the queues, as of the last iteration.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// Start starts the scheduler goroutine if it is not running. Submit calls
// it; it is idempotent and does nothing after Close.
func (e *Engine) Start() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.startLocked()
}

func (e *Engine) startLocked() {
	if e.started || e.closed {
		return
	}
	e.started = true
	go e.run()
}

// kick wakes the scheduler: a request arrived, a client cancelled, or the
// engine is closing.
func (e *Engine) kick() {
	e.mu.Lock()
	e.kickLocked()
	e.mu.Unlock()
}

func (e *Engine) kickLocked() {
	e.kicked = true
	if e.waitCancel != nil {
		e.waitCancel()
	}
}

// Submit validates req and queues it. Errors here are the request's fault
// (ErrBadRequest, *TooLongError, a missing transceiver for a disaggregated
// type) or the engine's state (ErrClosed, ErrQueueFull); after a successful
// Submit every outcome arrives on the stream. Cancelling ctx cancels the
// request in whatever phase it is: queued, prefilling, transferring (the
// transfer is cancelled and the peer told) or decoding; its blocks are
// released.
func (e *Engine) Submit(ctx context.Context, req Request) (*Stream, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r, err := e.newRequest(ctx, req)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	if len(e.inbox)+e.stats.Waiting >= e.opts.MaxQueue {
		return nil, fmt.Errorf("%w: %d requests waiting", ErrQueueFull, len(e.inbox)+e.stats.Waiting)
	}
	r.id = e.nextID.Add(1)
	r.submitted = e.now()
	r.stopAfter = context.AfterFunc(ctx, e.kick)
	e.inbox = append(e.inbox, r)
	e.startLocked()
	e.kickLocked()
	r.out.id = r.id
	return r.out, nil
}

func (e *Engine) newRequest(ctx context.Context, req Request) (*request, error) {
	if err := e.checkRequest(req); err != nil {
		return nil, err
	}
	r := &request{ctx: ctx, typ: req.Type, prompt: append(slices.Clone(req.Prompt), req.Resume...), promptLen: len(req.Prompt),
		maxTokens: req.MaxTokens, temp: req.Sampling.Temperature, stopToks: slices.Clone(req.StopTokenIDs), ignoreEOS: req.IgnoreEOS,
		text: newTextStream(req.Stop), state: transceiver.ContextInit}
	if r.maxTokens == 0 {
		r.maxTokens = e.opts.DefaultMaxTokens
	}
	if err := r.replay(req.Resume); err != nil {
		return nil, err
	}
	if e.opts.BlockReuse {
		r.root = kvcache.RootHash(req.CacheSalt)
		r.hashes = kvcache.HashBlocks(r.root, r.prompt, e.inst.tpb)
	}
	if req.Sampling.Seed != nil {
		r.seed = *req.Sampling.Seed
	} else {
		r.seed = rand.Uint64()
	}
	P := len(r.prompt)
	left := r.maxTokens - len(r.generated) // tokens still to generate
	r.reserve = P + left - 1
	switch req.Type {
	case transceiver.ContextOnly:
		r.reserve = P
	case transceiver.GenerationOnly:
		phase, err := checkContextPhase(req.ContextPhase)
		if err != nil {
			return nil, err
		}
		r.phase, r.state = phase, transceiver.DisaggGenerationInit
	}
	need := kvcache.BlocksForTokens(r.reserve, e.inst.tpb)
	if need > e.inst.NumBlocks() {
		mt := r.maxTokens
		if req.Type == transceiver.ContextOnly {
			mt = 0
		}
		return nil, &TooLongError{PromptTokens: P, MaxTokens: mt, NeedBlocks: need, PoolBlocks: e.inst.NumBlocks(), BlockTokens: e.inst.tpb}
	}
	r.out = newStream()
	return r, nil
}

// replay records the tokens of a resumed request as generated and runs
// the detokenizer over them without emitting anything, so that the text
// emitted from here on is what the uninterrupted request emits after them.
// Tokens that would have ended the request, or leave nothing to generate,
// are refused.
func (r *request) replay(resume []int32) error {
	if len(resume) == 0 {
		return nil
	}
	if len(resume) >= r.maxTokens {
		return badRequest("%d resumed tokens leave nothing to generate within max_tokens %d", len(resume), r.maxTokens)
	}
	r.generated = slices.Clone(resume)
	for i, tok := range resume {
		if tok < 0 || tok >= VocabSize {
			return badRequest("resumed token %d is %d, out of the vocabulary [0,%d)", i, tok, VocabSize)
		}
		_, hitStop := r.text.push(tok)
		if hitStop || tok == EOS && !r.ignoreEOS || slices.Contains(r.stopToks, tok) {
			return badRequest("resumed token %d (%d) ends the request: nothing to resume", i, tok)
		}
	}
	return nil
}

// badRequest is an ErrBadRequest saying what is wrong.
func badRequest(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrBadRequest}, args...)...)
}

// checkRequest checks what a caller can get wrong in req but its context
// phase: the type (the disaggregated ones need a transceiver), the prompt,
// max_tokens, the temperature and the stop strings.
func (e *Engine) checkRequest(req Request) error {
	switch req.Type {
	case transceiver.ContextAndGeneration:
	case transceiver.ContextOnly, transceiver.GenerationOnly:
		if e.tr == nil {
			return fmt.Errorf("%w: %s requests need a cache transceiver (cache_transceiver_config): %w",
				ErrBadRequest, req.Type, transceiver.ErrNoTransceiver)
		}
	default:
		return badRequest("request type %v", req.Type)
	}
	if len(req.Prompt) == 0 {
		return badRequest("empty prompt")
	}
	for i, t := range req.Prompt {
		if t < 0 || t >= VocabSize {
			return badRequest("prompt token %d is %d, out of the vocabulary [0,%d)", i, t, VocabSize)
		}
	}
	if req.MaxTokens < 0 {
		return badRequest("max_tokens %d", req.MaxTokens)
	}
	if temp := req.Sampling.Temperature; math.IsNaN(temp) || math.IsInf(temp, 0) || temp < 0 {
		return badRequest("temperature %v, want a finite value >= 0", temp)
	}
	if len(req.Stop) > MaxStopStrings {
		return badRequest("%d stop strings, at most %d", len(req.Stop), MaxStopStrings)
	}
	for _, st := range req.Stop {
		if len(st) > MaxStopLen {
			return badRequest("stop string of %d bytes, at most %d", len(st), MaxStopLen)
		}
	}
	return nil
}

// checkContextPhase checks the context phase of a generation_only request
// and returns a copy the request can keep.
func checkContextPhase(cp *transceiver.ContextPhaseParams) (*transceiver.ContextPhaseParams, error) {
	if cp == nil || len(cp.OpaqueState) == 0 {
		return nil, badRequest("generation_only request without context phase params (ctx_request_id, opaque state)")
	}
	if len(cp.FirstGenTokens) != 1 {
		return nil, badRequest("generation_only request with %d first_gen_tokens, want 1 (beam width 1)", len(cp.FirstGenTokens))
	}
	if t := cp.FirstGenTokens[0]; t < 0 || t >= VocabSize {
		return nil, badRequest("first_gen_token %d out of the vocabulary", t)
	}
	var op transceiver.OpaqueState
	if err := op.UnmarshalBinary(cp.OpaqueState); err != nil {
		return nil, badRequest("opaque state: %w", err)
	}
	return &transceiver.ContextPhaseParams{CtxRequestID: cp.CtxRequestID, FirstGenTokens: slices.Clone(cp.FirstGenTokens),
		DraftTokens: slices.Clone(cp.DraftTokens), OpaqueState: slices.Clone(cp.OpaqueState)}, nil
}

// CancelContext cancels a context_only request that the transceiver still
// holds for a generation instance, by its ctx_request_id (a router whose
// client went away before the generation side pulled): the blocks go back
// to the pools, and a generation instance that asks for it is refused. It
// reports whether a held request was cancelled.
func (e *Engine) CancelContext(ctxRequestID uint64) bool {
	e.mu.Lock()
	treq := e.held[ctxRequestID]
	e.mu.Unlock()
	if treq == nil {
		return false
	}
	return e.release(treq)
}

// release cancels a held context request for its owner, remembering that
// its end is a release, not a failure.
func (e *Engine) release(treq *transceiver.Request) bool {
	e.mu.Lock()
	e.released[treq.ID] = true
	e.mu.Unlock()
	ok := e.tr.Cancel(treq)
	if !ok {
		e.mu.Lock()
		delete(e.released, treq.ID)
		e.mu.Unlock()
	}
	return ok
}

// CancelContextState is CancelContext for a caller that must prove it
// holds the request: opaque must be the request's encoded opaque state,
// byte for byte (compared in constant time). The state carries a random
// transfer token, so only whoever was handed the context phase's answer
// can present it, and that one could pull the request anyway. It reports
// whether a held request was cancelled; an unknown id and a wrong state
// are both false, so a caller cannot learn which ids are held.
func (e *Engine) CancelContextState(ctxRequestID uint64, opaque []byte) bool {
	e.mu.Lock()
	treq := e.held[ctxRequestID]
	e.mu.Unlock()
	// ContextPhase was set by RespondAndSendAsync before the request was
	// put in held, under e.mu.
	if treq == nil || treq.ContextPhase == nil || len(opaque) == 0 ||
		subtle.ConstantTimeCompare(treq.ContextPhase.OpaqueState, opaque) != 1 {
		return false
	}
	ok := e.release(treq)
	e.kick() // collect the ended transfer now: held forgets it
	return ok
}

// Close stops the scheduler and ends every request still in the engine
// with ErrClosed. It closes the transceiver (which fails every transfer in
// flight and waits until none touches a block) before releasing the blocks
// of requests that were transferring, then closes the instance, and
// returns their errors: one wrapping kvcache.ErrBlocksInUse means blocks
// leaked. Idempotent.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.closed = true
		started := e.started
		e.kickLocked()
		e.mu.Unlock()
		e.stop()
		if started {
			<-e.done
		}
		var errs []error
		if e.tr != nil {
			if err := e.tr.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		e.finishTransfers()
		if err := e.inst.Close(); err != nil {
			errs = append(errs, err)
		}
		e.closeErr = errors.Join(errs...)
	})
	return e.closeErr
}

// run is the scheduler goroutine.
func (e *Engine) run() {
	defer close(e.done)
	for {
		e.mu.Lock()
		e.kicked = false
		e.waiting = append(e.waiting, e.inbox...)
		e.inbox = nil
		closed := e.closed
		e.mu.Unlock()
		if closed {
			e.shutdown()
			return
		}
		worked := e.step()
		if worked {
			e.iterations++
		}
		e.publish()
		if !worked {
			e.idle()
		}
	}
}

func (e *Engine) publish() {
	st := Stats{Waiting: len(e.waiting), Running: len(e.running), Transferring: len(e.transferring) + len(e.draining),
		FreeBlocks: e.inst.FreeBlocks(), TotalBlocks: e.inst.NumBlocks(), Iterations: e.iterations,
		PrefillTokens: e.prefilled, PrefillsStopped: e.stopped,
		PromptTokens: e.reuse.promptTokens, CachedTokens: e.reuse.cachedTokens, BlocksPublished: e.reuse.published,
		BlocksEvicted: e.inst.pools[0].Stats().Evictions}
	e.mu.Lock()
	st.UnpulledReleased = e.unpulledN
	e.stats = st
	e.mu.Unlock()
}

// step runs one iteration and reports whether it did anything.
func (e *Engine) step() bool {
	worked := e.reapCancelled()
	if e.tr != nil {
		// atLeast 0: collect what has finished, never block here.
		if done, err := e.tr.CheckContextTransferStatus(e.life, 0); err == nil {
			e.onCtxDone(done)
		}
		if done, err := e.tr.CheckGenTransferStatus(e.life, 0); err == nil && len(done) > 0 {
			e.onGenDone(done)
			worked = true
		}
	}
	if e.pollDraining() {
		worked = true
	}
	decoding := len(e.running)
	prefill := e.admit()
	for _, r := range prefill {
		e.prefill(r)
		worked = true
	}
	// One decode step for every request that was running before this
	// iteration's prefills (those join the next iteration), all of them
	// in one batch.
	batch := e.batch[:0]
	for _, r := range e.running[:decoding] {
		if !r.finished {
			batch = append(batch, r)
		}
	}
	if len(batch) > 0 {
		e.decodeBatch(batch)
		worked = true
	}
	clear(batch)
	e.batch = batch[:0]
	keep := e.running[:0]
	for _, r := range e.running {
		if !r.finished {
			keep = append(keep, r)
		}
	}
	clear(e.running[len(keep):])
	e.running = keep
	return worked
}

// idle blocks until something can happen. Following TensorRT-LLM's
// executor, the generation side blocks on transfers only when nothing else
// can run, and the context side blocks on its transfers only when requests
// wait for blocks the transceiver holds. A Submit, a client's cancel or
// Close interrupts the wait.
func (e *Engine) idle() {
	genPending := len(e.transferring) > 0
	prefillBlocked := e.tr != nil && len(e.waiting) > 0 && e.tr.PendingContext() > 0
	var wctx context.Context
	var cancel context.CancelFunc
	switch {
	case len(e.draining) > 0 || (genPending && prefillBlocked):
		// Two sources (or a draining request) to watch: poll.
		wctx, cancel = context.WithTimeout(e.life, pollInterval)
	case prefillBlocked:
		// Wake when a held request becomes one to release for the
		// waiting ones (ReleaseUnpulledAfter), if before a transfer ends.
		if d, ok := e.nextUnpulledDue(); ok {
			if d <= 0 {
				// Due, yet not released this iteration: being pulled.
				// Look again later, in case that pull stalls.
				d = unpulledRecheck
			}
			wctx, cancel = context.WithTimeout(e.life, d)
		} else {
			wctx, cancel = context.WithCancel(e.life)
		}
	default:
		wctx, cancel = context.WithCancel(e.life)
	}
	defer cancel()
	e.mu.Lock()
	if e.kicked || e.closed {
		e.mu.Unlock()
		return
	}
	e.waitCancel = cancel
	e.mu.Unlock()
	switch {
	case genPending:
		if done, err := e.tr.CheckGenTransferStatus(wctx, 1); err == nil {
			e.onGenDone(done)
		}
	case prefillBlocked:
		if done, err := e.tr.CheckContextTransferStatus(wctx, 1); err == nil {
			e.onCtxDone(done)
		}
	default:
		<-wctx.Done()
	}
	e.mu.Lock()
	e.waitCancel = nil
	e.mu.Unlock()
}

// reapCancelled ends the requests whose client has gone away. Requests
// whose transfer is in flight get the transfer cancelled; they end when the
// transceiver reports it, since until then it may write into their blocks.
func (e *Engine) reapCancelled() bool {
	worked := false
	gone := func(r *request) bool {
		if r.ctx.Err() == nil {
			return false
		}
		e.finish(r, FinishError, context.Cause(r.ctx))
		worked = true
		return true
	}
	e.waiting = slices.DeleteFunc(e.waiting, gone)
	e.running = slices.DeleteFunc(e.running, gone)
	for treq, r := range e.transferring {
		if !r.cancelled && r.ctx.Err() != nil {
			r.cancelled = true
			e.tr.Cancel(treq)
		}
	}
	return worked
}

// admit takes waiting requests in arrival order while their blocks can be
// allocated (first come, first served: a request that does not fit stops
// the admission of those behind it) and returns those to prefill.
// generation_only requests start their pull here.
func (e *Engine) admit() []*request {
	var prefill []*request
	budget := e.opts.MaxPrefillTokens
	n := 0
	for _, r := range e.waiting {
		active := len(e.running) + len(e.transferring) + len(e.draining) + len(prefill)
		if active >= e.opts.MaxBatch {
			break
		}
		// The budget counts the tokens to compute: a cached prefix is
		// not prefilled. (A peek: the match below may find less if a
		// reservation evicts, and the budget then takes what it finds.)
		if r.typ != transceiver.GenerationOnly && len(prefill) > 0 &&
			len(r.prompt)-e.peekCached(r.prompt, r.root, r.hashes) > budget {
			break
		}
		seq := e.inst.NewSequence()
		// The cached prefix is pinned before the rest is allocated, so
		// that the allocation cannot evict it.
		m := e.matchPrefix(r)
		seq.adopt(&m)
		err := seq.Reserve(r.reserve)
		if errors.Is(err, kvcache.ErrPoolExhausted) && m.src != nil {
			// The partial block holds a block the request needs more:
			// give it up. (The full blocks count towards the request's
			// own, so giving them up would not help.)
			m.drop(e.inst.pools)
			err = seq.Reserve(r.reserve)
		}
		e.drainEvictions()
		if err != nil {
			m.drop(e.inst.pools)
			seq.Release()
			if errors.Is(err, kvcache.ErrPoolExhausted) {
				e.releaseUnpulled()
				break
			}
			e.finish(r, FinishError, err)
			n++
			continue
		}
		seq.copyPartial(&m)
		n++
		r.seq = seq
		r.cached = seq.Len()
		r.published = r.cached / e.inst.tpb
		e.reuse.promptTokens += uint64(len(r.prompt))
		e.reuse.cachedTokens += uint64(r.cached)
		r.timing.Queue = e.now().Sub(r.submitted)
		if r.typ == transceiver.GenerationOnly {
			e.startTransfer(r)
			continue
		}
		budget -= len(r.prompt) - r.cached
		prefill = append(prefill, r)
	}
	clear(e.waiting[:n])
	e.waiting = e.waiting[n:]
	return prefill
}

// releaseUnpulled releases the oldest held context request that nobody
// is pulling and that has been held ReleaseUnpulledAfter, for a
// request that waits for blocks; none while one released so is still
// ending (its blocks come back when the transceiver reports it).
func (e *Engine) releaseUnpulled() {
	if e.tr == nil || e.opts.ReleaseUnpulledAfter < 0 {
		return
	}
	for _, treq := range e.unpulledCandidates() {
		if e.tr.Pulling(treq) {
			continue
		}
		e.mu.Lock()
		if _, still := e.held[treq.ID]; !still || e.released[treq.ID] {
			e.mu.Unlock()
			continue
		}
		e.unpulled[treq.ID] = true
		e.unpulledN++
		e.mu.Unlock()
		if !e.tr.Cancel(treq) {
			e.mu.Lock()
			delete(e.unpulled, treq.ID)
			e.unpulledN--
			e.mu.Unlock()
			continue
		}
		return
	}
}

// unpulledCandidates returns the held requests that may be released for
// a waiting request now, oldest first: none while one released so is
// still ending.
func (e *Engine) unpulledCandidates() []*transceiver.Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.unpulled) > 0 {
		return nil
	}
	due := e.now().Add(-e.opts.ReleaseUnpulledAfter)
	var out []*transceiver.Request
	for id, treq := range e.held {
		if at := e.heldAt[id]; !at.After(due) && !e.released[id] {
			out = append(out, treq)
		}
	}
	slices.SortFunc(out, func(a, b *transceiver.Request) int { return e.heldAt[a.ID].Compare(e.heldAt[b.ID]) })
	return out
}

// nextUnpulledDue is how long until the oldest held request becomes one
// releaseUnpulled may release (0: it is already; ok false: none held, or
// one released is still ending).
func (e *Engine) nextUnpulledDue() (time.Duration, bool) {
	if e.tr == nil || e.opts.ReleaseUnpulledAfter < 0 {
		return 0, false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.unpulled) > 0 {
		return 0, false // the one released is ending: its end wakes the scheduler
	}
	var oldest time.Time
	for id := range e.held {
		if at := e.heldAt[id]; !e.released[id] && (oldest.IsZero() || at.Before(oldest)) {
			oldest = at
		}
	}
	if oldest.IsZero() {
		return 0, false
	}
	return max(0, oldest.Add(e.opts.ReleaseUnpulledAfter).Sub(e.now())), true
}

// prefill runs a context phase: the prompt's forward pass and the first
// token. A context_only request is then handed to the transceiver and
// answered at once, before any KV moves; the engine drops its own
// reference to the blocks, which the transceiver holds until the pull or
// its deadline.
func (e *Engine) prefill(r *request) {
	start := e.now()
	// The model checks the client between layers and at least every 256
	// queries of the attention: one gone during a long prefill stops it there, and
	// its blocks go back now.
	logits, err := e.inst.prefill(r.ctx, r.seq, r.prompt[r.seq.Len():])
	if err == nil && r.ctx.Err() != nil {
		err = r.ctx.Err() // gone after the last layer: nobody will pull it
	}
	if err != nil {
		if r.ctx.Err() != nil {
			e.stopped++
			err = context.Cause(r.ctx)
		}
		e.finish(r, FinishError, err)
		return
	}
	e.prefilled += uint64(len(r.prompt) - r.cached)
	e.commitBlocks(r, r.prompt)
	tok := sampleToken(logits, r.temp, r.seed, len(r.generated))
	r.timing.Prefill = e.now().Sub(start)
	reason := e.appendToken(r, tok)
	if r.typ != transceiver.ContextOnly {
		if reason != "" {
			e.finish(r, reason, nil)
			return
		}
		r.state = transceiver.GenerationInProgress
		e.running = append(e.running, r)
		return
	}
	if reason == FinishStop { // nothing left for a generation instance
		e.finish(r, FinishStop, nil)
		return
	}
	r.treq = &transceiver.Request{ID: r.id, Type: transceiver.ContextOnly, Blocks: r.seq.Blocks(len(r.prompt)), NumTokens: len(r.prompt), PromptDigest: kvcache.PromptDigest(r.prompt),
		ContextPhase: &transceiver.ContextPhaseParams{FirstGenTokens: []int32{tok}}}
	if err := e.tr.RespondAndSendAsync(r.treq); err != nil {
		e.finish(r, FinishError, fmt.Errorf("engine: request %d: hand over to the transceiver: %w", r.id, err))
		return
	}
	r.state = transceiver.DisaggContextTransInProgress
	e.mu.Lock()
	e.held[r.id] = r.treq
	e.heldAt[r.id] = e.now()
	e.mu.Unlock()
	if reason == "" {
		reason = FinishNotFinished
	}
	e.finish(r, reason, nil)
}

// startTransfer starts pulling a generation_only request's KV cache into
// the blocks of its prompt.
func (e *Engine) startTransfer(r *request) {
	// Ask only for the blocks after the cached prefix: the context
	// instance sends the last len(Blocks[rank]) blocks of its request.
	blocks := r.seq.Blocks(len(r.prompt))
	skip := r.cached / e.inst.tpb
	for rank := range blocks {
		blocks[rank] = blocks[rank][skip:]
	}
	r.treq = &transceiver.Request{ID: r.id, Type: transceiver.GenerationOnly, Blocks: blocks, NumTokens: len(r.prompt), PromptDigest: kvcache.PromptDigest(r.prompt),
		ContextPhase: r.phase}
	r.treq.SetState(transceiver.DisaggGenerationInit)
	r.xferStart = e.now()
	r.timing.TransferBlocks, r.timing.BlockBytes = 0, 0
	for rank, b := range r.treq.Blocks {
		if len(b) > 0 {
			r.timing.TransferBlocks = len(b)
			r.timing.BlockBytes += e.inst.pools[rank].BlockBytes()
		}
	}
	if err := e.tr.RequestAndReceiveAsync(r.treq); err != nil {
		err = fmt.Errorf("%w: request %d (context request %d): %w", ErrTransfer, r.id, r.phase.CtxRequestID, err)
		if r.treq.State() == transceiver.DisaggGenerationTransInProgress {
			// Some ranks had started: they are being cancelled and may
			// still write into the blocks. Keep them until they stop.
			r.startErr = err
			e.draining = append(e.draining, r)
			return
		}
		r.state = transceiver.DisaggTransError
		e.finish(r, FinishError, err)
		return
	}
	r.state = transceiver.DisaggGenerationTransInProgress
	e.transferring[r.treq] = r
}

// pollDraining ends the requests whose failed start has wound down.
func (e *Engine) pollDraining() bool {
	worked := false
	e.draining = slices.DeleteFunc(e.draining, func(r *request) bool {
		if r.treq.State() == transceiver.DisaggGenerationTransInProgress {
			return false
		}
		r.state = transceiver.DisaggTransError
		e.finish(r, FinishError, r.startErr)
		worked = true
		return true
	})
	return worked
}

// onGenDone handles finished pulls: failures end their request; successes
// emit the context instance's first token and join the decoding requests.
func (e *Engine) onGenDone(done []*transceiver.Request) {
	for _, treq := range done {
		r := e.transferring[treq]
		if r == nil {
			e.rl.Warn("unknown-transfer", "transfer of an unknown request reported", "request", treq.ID)
			continue
		}
		delete(e.transferring, treq)
		r.timing.KVTransfer = e.now().Sub(r.xferStart)
		r.timing.TransferBytes = treq.Stats().Bytes
		r.state = treq.State()
		switch {
		case r.ctx.Err() != nil:
			e.finish(r, FinishError, context.Cause(r.ctx))
			continue
		case r.state != transceiver.DisaggGenerationTransComplete:
			e.finish(r, FinishError, fmt.Errorf("%w: request %d (context request %d): %w", ErrTransfer, r.id, r.phase.CtxRequestID, treq.Err()))
			continue
		}
		if err := r.seq.SetLen(len(r.prompt)); err != nil {
			e.finish(r, FinishError, err)
			continue
		}
		e.commitBlocks(r, r.prompt)
		r.state = transceiver.GenerationInProgress
		treq.SetState(r.state)
		if reason := e.appendToken(r, r.phase.FirstGenTokens[0]); reason != "" {
			e.finish(r, reason, nil)
			continue
		}
		e.running = append(e.running, r)
	}
}

// onCtxDone logs the context transfers that ended (their blocks are back in
// the pools).
func (e *Engine) onCtxDone(done []*transceiver.Request) {
	if len(done) == 0 {
		return
	}
	released := make([]bool, len(done))
	e.mu.Lock()
	unpulled := make([]bool, len(done))
	for i, treq := range done {
		delete(e.held, treq.ID)
		delete(e.heldAt, treq.ID)
		released[i] = e.released[treq.ID]
		delete(e.released, treq.ID)
		unpulled[i] = e.unpulled[treq.ID]
		delete(e.unpulled, treq.ID)
	}
	e.mu.Unlock()
	for i, treq := range done {
		switch err := treq.Err(); {
		case unpulled[i] && errors.Is(err, transceiver.ErrCanceled):
			e.rl.Warn("context-unpulled", "held context request released for a request waiting for blocks: nobody was pulling it",
				"ctx_request", treq.ID, "after", e.opts.ReleaseUnpulledAfter)
		case released[i] && errors.Is(err, transceiver.ErrCanceled):
			// Released by its owner (the router: its generation phase
			// will not come): nothing went wrong here.
			e.log.Debug("context request released", "ctx_request", treq.ID, "err", err)
		case err != nil:
			// One line per cause per second: an outage of the generation
			// side fails every held request alike.
			e.rl.Warn("context-transfer:"+transferCause(err), "context transfer failed", "ctx_request", treq.ID, "cause", transferCause(err), "err", err)
		default:
			st := treq.Stats()
			e.log.Debug("context transfer done", "ctx_request", treq.ID, "bytes", st.Bytes, "duration", st.Duration, "backend", st.Backend)
		}
	}
}

// transferCause names the cause of a transfer failure, for the rate
// limit of its warnings.
func transferCause(err error) string {
	for _, c := range []struct {
		err  error
		name string
	}{
		{transceiver.ErrTimeout, "timeout"}, {transceiver.ErrPeerLost, "peer_lost"}, {transceiver.ErrPeerAborted, "peer_aborted"},
		{transceiver.ErrRefused, "refused"}, {transceiver.ErrClosed, "closed"}, {transceiver.ErrCanceled, "cancelled"},
	} {
		if errors.Is(err, c.err) {
			return c.name
		}
	}
	return "other"
}

// decodeBatch runs one token of every request of rs in one forward pass
// (Instance.DecodeBatch: each request's logits are those of a decode on
// its own). A batch the instance refuses whole runs request by request,
// so that only the requests at fault end.
func (e *Engine) decodeBatch(rs []*request) {
	if len(rs) == 1 {
		e.decodeStep(rs[0])
		return
	}
	start := e.now()
	seqs, toks := e.batchSeqs[:0], e.batchToks[:0]
	for _, r := range rs {
		seqs = append(seqs, r.seq)
		toks = append(toks, r.generated[len(r.generated)-1])
	}
	lgs, err := e.inst.DecodeBatch(seqs, toks)
	clear(seqs)
	e.batchSeqs, e.batchToks = seqs[:0], toks[:0]
	if err != nil {
		for _, r := range rs {
			e.decodeStep(r)
		}
		return
	}
	d := e.now().Sub(start)
	for i, r := range rs {
		e.decoded(r, lgs[i], d)
	}
}

// decodeStep runs one token of a running request.
func (e *Engine) decodeStep(r *request) {
	start := e.now()
	logits, err := e.inst.Decode(r.seq, r.generated[len(r.generated)-1])
	if err != nil {
		e.finish(r, FinishError, err)
		return
	}
	e.decoded(r, logits, e.now().Sub(start))
}

// decoded samples a request's next token from the logits of a decode step
// that took d and emits it.
func (e *Engine) decoded(r *request, logits []float32, d time.Duration) {
	tok := sampleToken(logits, r.temp, r.seed, len(r.generated))
	if r.decodes == 0 {
		r.timing.FirstDecode = d
	}
	r.decodes++
	r.timing.Decode += d
	if reason := e.appendToken(r, tok); reason != "" {
		e.finish(r, reason, nil)
	}
}

// appendToken records and emits a generated token and returns why the
// request stops after it ("" to go on).
func (e *Engine) appendToken(r *request, tok int32) string {
	r.generated = append(r.generated, tok)
	piece, hitStop := r.text.push(tok)
	r.out.push(Event{Token: tok, Text: piece})
	switch {
	case hitStop, tok == EOS && !r.ignoreEOS, slices.Contains(r.stopToks, tok):
		return FinishStop
	case len(r.generated) >= r.maxTokens:
		return FinishLength
	}
	return ""
}

// finish ends a request: its blocks go back (a context_only request's stay
// held by the transceiver), the final event goes out, the stream closes.
func (e *Engine) finish(r *request, reason string, err error) {
	if r.finished {
		return
	}
	r.finished = true
	if err == nil && r.seq != nil && r.typ != transceiver.ContextOnly {
		// The blocks the generated tokens filled, full blocks only.
		// The cache holds the prompt (with the resumed tokens, which
		// generated starts with) and then the generated tokens fed back.
		e.commitBlocks(r, append(r.prompt[:len(r.prompt):len(r.prompt)], r.generated[len(r.prompt)-r.promptLen:]...))
	}
	if r.seq != nil {
		if rerr := r.seq.Release(); rerr != nil {
			e.log.Error("release blocks", "request", r.id, "err", rerr)
		}
	}
	r.stopAfter()
	switch {
	case err != nil:
		reason = FinishError
	case r.state == transceiver.GenerationInProgress, r.state == transceiver.ContextInit:
		r.state = transceiver.GenerationComplete
	}
	if r.treq != nil && r.typ == transceiver.GenerationOnly {
		r.treq.SetState(r.state)
	}
	r.timing.Total = e.now().Sub(r.submitted)
	f := &Final{FinishReason: reason, Err: err, State: r.state, Timing: r.timing,
		Usage: Usage{PromptTokens: r.promptLen, CompletionTokens: len(r.generated), CachedTokens: min(r.cached, r.promptLen)}, PromptTokenIDs: r.prompt[:r.promptLen:r.promptLen]}
	if r.typ == transceiver.ContextOnly && r.treq != nil && err == nil {
		cp := r.treq.ContextPhase
		f.ContextPhase = &transceiver.ContextPhaseParams{CtxRequestID: cp.CtxRequestID,
			FirstGenTokens: slices.Clone(cp.FirstGenTokens), OpaqueState: slices.Clone(cp.OpaqueState)}
	}
	r.out.push(Event{Token: NoToken, Text: r.text.flush(), Final: f})
	if err != nil && !errors.Is(err, context.Canceled) {
		e.log.Info("request failed", "request", r.id, "type", r.typ.String(), "err", err)
	}
}

// shutdown ends the requests that hold no transfer, on Close, and cancels
// the transfers in flight (their peers get an abort). Their requests end in
// Close, once the transceiver is closed and can no longer write into their
// blocks.
func (e *Engine) shutdown() {
	for _, r := range e.waiting {
		e.finish(r, FinishError, ErrClosed)
	}
	e.waiting = nil
	for _, r := range e.running {
		e.finish(r, FinishError, ErrClosed)
	}
	e.running = nil
	for treq := range e.transferring {
		e.tr.Cancel(treq)
	}
}

// finishTransfers ends, after the scheduler has exited and the transceiver
// is closed, the requests whose transfers were in flight at Close.
func (e *Engine) finishTransfers() {
	for treq, r := range e.transferring {
		r.state = transceiver.DisaggTransError
		e.finish(r, FinishError, ErrClosed)
		delete(e.transferring, treq)
	}
	for _, r := range e.draining {
		r.state = transceiver.DisaggTransError
		e.finish(r, FinishError, ErrClosed)
	}
	e.draining = nil
}
