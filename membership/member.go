package membership

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// MemberOptions are a registration's settings.
type MemberOptions struct {
	// Cluster is disagg_cluster.cluster_name.
	Cluster string
	// Interval is how often the lease is renewed
	// (heartbeat_interval_sec); TTL is the lease's time to live
	// (inactive_timeout_sec). 2 × Interval ≤ TTL (config.CheckHeartbeat
	// states why).
	Interval, TTL time.Duration
	// Logger gets renewal failures and re-registrations; nil: slog.Default.
	Logger *slog.Logger
}

// MemberStatus is a registration's state, for logs and metrics.
type MemberStatus struct {
	Registered      bool
	Lease           LeaseID
	LastRenewal     time.Time // when the last successful keep-alive was sent
	Renewals        uint64    // successful keep-alives
	Failures        uint64    // failed or timed-out keep-alive attempts
	Reregistrations uint64    // leases lost and granted again
	LastErr         error
}

// Member is one worker's registration. Register puts the record and starts
// the keep-alive goroutine; Deregister (or Close) stops it and revokes the
// lease, which deletes the record at once. Methods may be called from any
// goroutine. The Member does not own the Store: the caller closes it
// after the Member.
type Member struct {
	store Store
	opts  MemberOptions
	rec   Record
	key   string
	value []byte
	log   *slog.Logger

	mu      sync.Mutex
	status  MemberStatus
	started bool
	done    bool
	stop    context.CancelFunc
	exited  chan struct{}
}

// NewMember checks rec and opts and returns a Member not yet registered.
// rec.RegisteredAt is set by Register.
func NewMember(store Store, rec Record, opts MemberOptions) (*Member, error) {
	if opts.Interval <= 0 || 2*opts.Interval > opts.TTL {
		return nil, fmt.Errorf("%w: interval %v and ttl %v: need 2 × interval ≤ ttl", ErrInvalid, opts.Interval, opts.TTL)
	}
	if err := rec.Validate(); err != nil {
		return nil, err
	}
	id, err := rec.ID()
	if err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	key := Key(opts.Cluster, rec.Role, id)
	if _, _, _, err := ParseKey(opts.Cluster, key); err != nil {
		return nil, err
	}
	return &Member{store: store, opts: opts, rec: rec, key: key, log: opts.Logger.With("member", key)}, nil
}

// Key is the member's key in the store.
func (m *Member) Key() string { return m.key }

// Record is the record as registered (RegisteredAt set once registered).
func (m *Member) Record() Record {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rec
}

// Status returns the registration's state.
func (m *Member) Status() MemberStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.status
}

// Register grants the lease, puts the record and starts the keep-alive
// goroutine. It fails, leaving nothing behind, when the store does, and
// may then be called again; once it succeeded, or after Deregister or
// Close, it returns ErrClosed.
func (m *Member) Register(ctx context.Context) error {
	m.mu.Lock()
	if m.done || m.started {
		m.mu.Unlock()
		return fmt.Errorf("%w: member %s registers once", ErrClosed, m.key)
	}
	m.started = true
	m.rec.RegisteredAt = time.Now().UTC()
	v, err := EncodeRecord(&m.rec)
	m.mu.Unlock()
	if err == nil {
		m.value = v
	}
	var lease LeaseID
	var sent time.Time
	if err == nil {
		lease, sent, err = m.grantPut(ctx)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		m.started = false // Register may be tried again
		return err
	}
	if m.done { // closed while registering
		rctx, cancel := context.WithTimeout(context.Background(), m.opts.Interval)
		defer cancel()
		_ = m.store.Revoke(rctx, lease)
		return fmt.Errorf("%w: member %s closed while registering", ErrClosed, m.key)
	}
	m.status.Registered, m.status.Lease, m.status.LastRenewal = true, lease, sent
	loopCtx, stop := context.WithCancel(context.Background())
	m.stop, m.exited = stop, make(chan struct{})
	go m.keepAlive(loopCtx, lease, sent)
	return nil
}

// grantPut grants a lease and puts the record under it. sent is when the
// grant was sent: the lease lives at least until sent + TTL.
func (m *Member) grantPut(ctx context.Context) (LeaseID, time.Time, error) {
	sent := time.Now()
	lease, _, err := m.store.Grant(ctx, m.opts.TTL)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("membership: grant for %s: %w", m.key, err)
	}
	if _, err := m.store.Put(ctx, m.key, m.value, lease); err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.opts.Interval)
		defer cancel()
		_ = m.store.Revoke(rctx, lease)
		return 0, time.Time{}, fmt.Errorf("membership: put %s: %w", m.key, err)
	}
	return lease, sent, nil
}

// keepAlive renews the lease every Interval. An attempt that fails is
// retried at once with backoff, each attempt bounded by half the lease time
// left (the whole of it when little is left), so that several attempts fit
// before the lease can expire. Only the store decides that the lease is
// gone (ErrLeaseNotFound): past the time the lease was sure to last, the
// worker keeps trying at the interval's pace, since its renewals may have
// arrived with only their answers lost, and a lease that did expire is
// granted again and the record put back.
func (m *Member) keepAlive(ctx context.Context, lease LeaseID, renewed time.Time) {
	defer close(m.exited)
	for {
		if !sleepUntil(ctx, renewed.Add(m.opts.Interval)) {
			return
		}
		lost := false
		backoff := min(50*time.Millisecond, m.opts.Interval/4)
		for {
			left := time.Until(renewed.Add(m.opts.TTL))
			attempt := m.opts.Interval
			if left > 0 {
				attempt = max(left/2, min(left, 200*time.Millisecond))
			}
			actx, cancel := context.WithTimeout(ctx, attempt)
			sent := time.Now()
			_, err := m.store.KeepAlive(actx, lease)
			cancel()
			if err == nil {
				renewed = sent
				m.update(func(s *MemberStatus) { s.Renewals++; s.LastRenewal = sent })
				break
			}
			if ctx.Err() != nil {
				return
			}
			m.update(func(s *MemberStatus) { s.Failures++; s.LastErr = err })
			if errors.Is(err, ErrLeaseNotFound) {
				lost = true
				break
			}
			left = time.Until(renewed.Add(m.opts.TTL))
			m.log.Warn("membership: keep-alive failed, retrying", "err", err, "lease_left", left.Round(time.Millisecond))
			wait := backoff
			if left > 0 {
				wait = min(backoff, left/4)
			}
			if !sleepUntil(ctx, time.Now().Add(wait)) {
				return
			}
			backoff = min(2*backoff, m.opts.Interval)
		}
		if !lost {
			continue
		}
		// The store dropped the lease (or it ran out while unreachable):
		// the router has seen the record go. Register again, same key.
		m.update(func(s *MemberStatus) { s.Registered = false })
		m.log.Warn("membership: lease lost, registering again")
		backoff = min(100*time.Millisecond, m.opts.Interval)
		for {
			gctx, cancel := context.WithTimeout(ctx, m.opts.TTL)
			l, sent, err := m.grantPut(gctx)
			cancel()
			if err == nil {
				lease, renewed = l, sent
				m.update(func(s *MemberStatus) {
					s.Registered, s.Lease, s.LastRenewal = true, l, sent
					s.Reregistrations++
				})
				break
			}
			if ctx.Err() != nil {
				return
			}
			m.update(func(s *MemberStatus) { s.LastErr = err })
			if !sleepUntil(ctx, time.Now().Add(backoff)) {
				return
			}
			backoff = min(2*backoff, m.opts.Interval)
		}
	}
}

func (m *Member) update(f func(*MemberStatus)) {
	m.mu.Lock()
	f(&m.status)
	m.mu.Unlock()
}

// Deregister stops the keep-alives and revokes the lease, deleting the
// record at once (a worker leaving gracefully does this first). It is
// idempotent; after it the Member is done. ctx bounds the revoke.
func (m *Member) Deregister(ctx context.Context) error {
	m.mu.Lock()
	if m.done {
		m.mu.Unlock()
		return nil
	}
	m.done = true
	stop, exited := m.stop, m.exited
	m.mu.Unlock()
	if exited == nil { // never registered, or Register still running: it revokes
		return nil
	}
	stop()
	<-exited
	m.mu.Lock()
	lease, registered := m.status.Lease, m.status.Registered
	m.status.Registered = false
	m.mu.Unlock()
	if !registered {
		return nil
	}
	if err := m.store.Revoke(ctx, lease); err != nil && !errors.Is(err, ErrLeaseNotFound) {
		return fmt.Errorf("membership: revoke %s: %w", m.key, err)
	}
	return nil
}

// Close is Deregister bounded by the heartbeat interval (at least 1 s).
func (m *Member) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), max(time.Second, m.opts.Interval))
	defer cancel()
	return m.Deregister(ctx)
}

// sleepUntil waits until t or ctx's end; it reports whether ctx is live.
func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-ctx.Done():
		return false
	}
}
