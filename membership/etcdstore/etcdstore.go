package etcdstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvxfer/kvxfer/membership"
)

// Options are the etcd client's settings. Zero fields take the defaults.
type Options struct {
	// DialTimeout bounds Dial's first connection (default 5 s).
	DialTimeout time.Duration
	// KeepAliveTime and KeepAliveTimeout are the gRPC connection's
	// pings (default 10 s and 5 s): a dead connection is noticed within
	// their sum, well before a lease can expire unnoticed.
	KeepAliveTime, KeepAliveTimeout time.Duration
	// MaxList bounds the keys one List returns (default 100000); a
	// larger prefix is ErrLimit.
	MaxList int64
	// Username and Password, when set, authenticate to etcd.
	Username, Password string
	// TLS, when not nil, makes the client speak TLS to etcd with it
	// (server verification, and a client certificate if it has one).
	TLS *tls.Config
}

// Store is a membership.Store on an etcd cluster. Its methods may be
// called from any goroutine.
type Store struct {
	cli       *clientv3.Client
	opts      Options
	endpoints []string

	mu     sync.Mutex
	closed bool
	diag   string    // the last diagnosis of a connection failure
	diagAt time.Time // when it was made
}

var _ membership.Store = (*Store)(nil)

// Dial connects to the etcd cluster at endpoints (host:port each). It
// starts the client's connection goroutines, which Close ends.
func Dial(ctx context.Context, endpoints []string, opts Options) (*Store, error) {
	if len(endpoints) == 0 {
		return nil, fmt.Errorf("%w: no etcd endpoints", membership.ErrInvalid)
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = 5 * time.Second
	}
	if opts.KeepAliveTime <= 0 {
		opts.KeepAliveTime = 10 * time.Second
	}
	if opts.KeepAliveTimeout <= 0 {
		opts.KeepAliveTimeout = 5 * time.Second
	}
	if opts.MaxList <= 0 {
		opts.MaxList = 100000
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            endpoints,
		DialTimeout:          opts.DialTimeout,
		DialKeepAliveTime:    opts.KeepAliveTime,
		DialKeepAliveTimeout: opts.KeepAliveTimeout,
		Username:             opts.Username,
		Password:             opts.Password,
		TLS:                  opts.TLS,
		Context:              context.WithoutCancel(ctx),
		Logger:               zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("etcdstore: connecting to %v: %w", endpoints, err)
	}
	return &Store{cli: cli, opts: opts, endpoints: slices.Clone(endpoints)}, nil
}

// Client is the underlying etcd client (tests compact through it).
func (s *Store) Client() *clientv3.Client { return s.cli }

func (s *Store) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// wrap maps etcd's errors to membership's sentinels.
func (s *Store) wrap(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case s.isClosed():
		return membership.ErrClosed
	case errors.Is(err, rpctypes.ErrLeaseNotFound):
		return fmt.Errorf("etcdstore: %s: %w", op, membership.ErrLeaseNotFound)
	case errors.Is(err, rpctypes.ErrCompacted):
		return fmt.Errorf("etcdstore: %s: %w", op, membership.ErrCompacted)
	case errors.Is(err, rpctypes.ErrRequestTooLarge), errors.Is(err, rpctypes.ErrTooManyRequests):
		return fmt.Errorf("etcdstore: %s: %w: %v", op, membership.ErrLimit, err)
	}
	// Any other failure but the caller's cancel may be etcd being out of
	// reach (the client reports that as a deadline or "unavailable").
	if !errors.Is(err, context.Canceled) {
		if why := s.diagnose(); why != "" {
			return fmt.Errorf("etcdstore: %s: %w (%s)", op, err, why)
		}
	}
	return fmt.Errorf("etcdstore: %s: %w", op, err)
}

// diagnoseEvery bounds how often a failing store probes etcd itself.
const diagnoseEvery = 5 * time.Second

// diagnose says, when it can tell, why etcd does not answer: the gRPC
// client retries a refused TLS handshake until the operation's deadline
// and then reports only the deadline. It probes the first endpoint itself
// (at most once per diagnoseEvery) and returns "" when the probe finds
// nothing wrong.
func (s *Store) diagnose() string {
	s.mu.Lock()
	if time.Since(s.diagAt) < diagnoseEvery {
		d := s.diag
		s.mu.Unlock()
		return d
	}
	s.mu.Unlock()
	d := probe(s.endpoints[0], s.opts.TLS)
	s.mu.Lock()
	s.diag, s.diagAt = d, time.Now()
	s.mu.Unlock()
	return d
}

// probe dials endpoint and, with tc, makes a TLS handshake with it and
// waits briefly for a refusal of the client's certificate (under TLS 1.3
// the server checks it after the client's side of the handshake ends);
// without tc it tells whether the endpoint speaks TLS only. It returns
// what it found wrong, or "", within a second in all.
func probe(endpoint string, tc *tls.Config) string {
	deadline := time.Now().Add(time.Second)
	conn, err := net.DialTimeout("tcp", endpoint, time.Until(deadline))
	if err != nil {
		return fmt.Sprintf("cannot reach etcd at %s: %v", endpoint, err)
	}
	defer conn.Close()
	conn.SetDeadline(deadline)
	if tc == nil {
		// Only to tell whether the server speaks TLS: no data is sent.
		err := tls.Client(conn, &tls.Config{InsecureSkipVerify: true}).Handshake()
		if err == nil || remoteAlert(err) {
			return fmt.Sprintf("etcd at %s serves TLS only: set security.etcd.ca_file (and cert_file and key_file if it requires client certificates)", endpoint)
		}
		return ""
	}
	c := tc.Clone()
	if c.ServerName == "" {
		c.ServerName, _, _ = net.SplitHostPort(endpoint)
	}
	tlc := tls.Client(conn, c)
	if err := tlc.Handshake(); err != nil {
		return fmt.Sprintf("TLS handshake with etcd at %s: %v", endpoint, err)
	}
	if soon := time.Now().Add(300 * time.Millisecond); soon.Before(deadline) {
		tlc.SetReadDeadline(soon)
	}
	var b [1]byte
	if _, err := tlc.Read(b[:]); err != nil && remoteAlert(err) {
		return fmt.Sprintf("etcd at %s refused this client's TLS: %v", endpoint, err)
	}
	return ""
}

// remoteAlert reports whether err is a TLS alert the peer sent (crypto/tls
// returns those as a *net.OpError whose Op is "remote error").
func remoteAlert(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "remote error"
}

// Grant implements membership.Store.
func (s *Store) Grant(ctx context.Context, ttl time.Duration) (membership.LeaseID, time.Duration, error) {
	if s.isClosed() {
		return 0, 0, membership.ErrClosed
	}
	secs := int64((ttl + time.Second - 1) / time.Second)
	r, err := s.cli.Grant(ctx, max(secs, 1))
	if err != nil {
		return 0, 0, s.wrap("grant", err)
	}
	return membership.LeaseID(r.ID), time.Duration(r.TTL) * time.Second, nil
}

// KeepAlive implements membership.Store.
func (s *Store) KeepAlive(ctx context.Context, id membership.LeaseID) (time.Duration, error) {
	if s.isClosed() {
		return 0, membership.ErrClosed
	}
	r, err := s.cli.KeepAliveOnce(ctx, clientv3.LeaseID(id))
	if err != nil {
		return 0, s.wrap("keep-alive", err)
	}
	return time.Duration(r.TTL) * time.Second, nil
}

// Revoke implements membership.Store.
func (s *Store) Revoke(ctx context.Context, id membership.LeaseID) error {
	if s.isClosed() {
		return membership.ErrClosed
	}
	_, err := s.cli.Revoke(ctx, clientv3.LeaseID(id))
	return s.wrap("revoke", err)
}

// Put implements membership.Store.
func (s *Store) Put(ctx context.Context, key string, value []byte, id membership.LeaseID) (int64, error) {
	if s.isClosed() {
		return 0, membership.ErrClosed
	}
	if key == "" || len(key) > membership.MaxKeySize {
		return 0, fmt.Errorf("%w: key of %d bytes (1..%d)", membership.ErrInvalid, len(key), membership.MaxKeySize)
	}
	var opts []clientv3.OpOption
	if id != 0 {
		opts = append(opts, clientv3.WithLease(clientv3.LeaseID(id)))
	}
	r, err := s.cli.Put(ctx, key, string(value), opts...)
	if err != nil {
		return 0, s.wrap("put", err)
	}
	return r.Header.Revision, nil
}

// List implements membership.Store.
func (s *Store) List(ctx context.Context, prefix string) ([]membership.KV, int64, error) {
	if s.isClosed() {
		return nil, 0, membership.ErrClosed
	}
	if prefix == "" {
		return nil, 0, fmt.Errorf("%w: empty prefix", membership.ErrInvalid)
	}
	r, err := s.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithLimit(s.opts.MaxList),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return nil, 0, s.wrap("list", err)
	}
	if r.More {
		return nil, 0, fmt.Errorf("etcdstore: list %s: %w: more than %d keys", prefix, membership.ErrLimit, s.opts.MaxList)
	}
	out := make([]membership.KV, len(r.Kvs))
	for i, kv := range r.Kvs {
		out[i] = membership.KV{Key: string(kv.Key), Value: kv.Value, CreateRev: kv.CreateRevision, ModRev: kv.ModRevision, Lease: membership.LeaseID(kv.Lease)}
	}
	return out, r.Header.Revision, nil
}

// Watch implements membership.Store.
func (s *Store) Watch(ctx context.Context, prefix string, fromRev int64) (membership.Watcher, error) {
	if s.isClosed() {
		return nil, membership.ErrClosed
	}
	if prefix == "" || fromRev < 0 {
		return nil, fmt.Errorf("%w: watch of %q from %d", membership.ErrInvalid, prefix, fromRev)
	}
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(context.Background()))
	opts := []clientv3.OpOption{clientv3.WithPrefix()}
	if fromRev > 0 {
		opts = append(opts, clientv3.WithRev(fromRev))
	}
	return &watcher{s: s, ch: s.cli.Watch(wctx, prefix, opts...), cancel: cancel}, nil
}

// Close implements membership.Store.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	if err := s.cli.Close(); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("etcdstore: close: %w", err)
	}
	return nil
}

type watcher struct {
	s      *Store
	ch     clientv3.WatchChan
	cancel context.CancelFunc
	once   sync.Once
}

// Next implements membership.Watcher.
func (w *watcher) Next(ctx context.Context) ([]membership.Event, error) {
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case r, ok := <-w.ch:
			if !ok {
				if w.s.isClosed() {
					return nil, membership.ErrClosed
				}
				return nil, errors.New("etcdstore: watch ended")
			}
			if r.CompactRevision != 0 {
				return nil, fmt.Errorf("etcdstore: watch: %w (compacted up to %d)", membership.ErrCompacted, r.CompactRevision)
			}
			if err := r.Err(); err != nil {
				return nil, w.s.wrap("watch", err)
			}
			if r.Canceled {
				return nil, errors.New("etcdstore: watch canceled by the server")
			}
			if len(r.Events) == 0 {
				continue // progress notification or creation
			}
			out := make([]membership.Event, len(r.Events))
			for i, e := range r.Events {
				out[i] = membership.Event{Key: string(e.Kv.Key), Rev: e.Kv.ModRevision}
				if e.Type == clientv3.EventTypeDelete {
					out[i].Type = membership.EventDelete
				} else {
					out[i].Type, out[i].Value = membership.EventPut, e.Kv.Value
				}
			}
			return out, nil
		}
	}
}

// Close implements membership.Watcher.
func (w *watcher) Close() error {
	w.once.Do(w.cancel)
	return nil
}
