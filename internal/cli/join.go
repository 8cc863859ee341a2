package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/connect"
)

// Graceful leave of a worker (kvxfer serve): on SIGTERM it deregisters,
// keeps serving for leaveGrace (the router sees the leave within
// milliseconds; a request already on its way still lands), stops taking
// connections, finishes the requests in flight within termDrain, then
// keeps the context requests whose KV has not been pulled until they are
// pulled or kv_transfer_timeout_ms ends, and exits. On SIGINT the same
// within intDrain in all.
const (
	leaveGrace = 500 * time.Millisecond
	termDrain  = 30 * time.Second
	intDrain   = 2 * time.Second
)

// advertiseHost is the host of the worker's advertised URL: --advertise-host
// when set; else the listen host unless it is unspecified (0.0.0.0, ::,
// ""), when it is this host's name if that resolves to a non-loopback
// address, else the first non-loopback IPv4 address of an interface that
// is up. Never 0.0.0.0.
func advertiseHost(flag, listen string) (string, error) {
	if flag != "" {
		if ip := net.ParseIP(flag); ip != nil && ip.IsUnspecified() {
			return "", fmt.Errorf("--advertise-host %s: no address a peer can reach", flag)
		}
		return flag, nil
	}
	if ip := net.ParseIP(listen); listen != "" && (ip == nil || !ip.IsUnspecified()) {
		return listen, nil
	}
	if h, err := os.Hostname(); err == nil && h != "" {
		if addrs, err := net.LookupIP(h); err == nil {
			for _, a := range addrs {
				if !a.IsLoopback() && !a.IsUnspecified() {
					return h, nil
				}
			}
		}
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
				return n.IP.String(), nil
			}
		}
	}
	return "", fmt.Errorf("listening on %s: no non-loopback IPv4 address to advertise; set --advertise-host", listen)
}

// joiner is a worker's membership: it registers in the background (the
// store, e.g. the router's built-in one, may come up after the worker)
// and deregisters on leave.
type joiner struct {
	store membership.Store
	m     *membership.Member
	log   *slog.Logger
	stop  context.CancelFunc
	done  chan struct{}

	mu         sync.Mutex
	registered bool
}

// startJoin starts registering rec in the store of dc.
func startJoin(ctx context.Context, dc *config.DisaggCluster, rec membership.Record, secret []byte, etcd config.EtcdClient, log *slog.Logger) (*joiner, error) {
	st, err := connect.Open(ctx, *dc, connect.Options{Token: connect.Token(secret), EtcdClient: etcd})
	if err != nil {
		return nil, fmt.Errorf("disagg_cluster: %w", err)
	}
	mo := connect.MemberOptions(*dc)
	mo.Logger = log
	m, err := membership.NewMember(st, rec, mo)
	if err != nil {
		st.Close()
		return nil, fmt.Errorf("disagg_cluster: %w", err)
	}
	j := &joiner{store: st, m: m, log: log, done: make(chan struct{})}
	var jctx context.Context
	jctx, j.stop = context.WithCancel(context.WithoutCancel(ctx))
	go j.register(jctx, dc)
	return j, nil
}

func (j *joiner) register(ctx context.Context, dc *config.DisaggCluster) {
	defer close(j.done)
	pause := time.NewTimer(0)
	defer pause.Stop()
	for attempt := 0; ; attempt++ {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := j.m.Register(rctx)
		cancel()
		if err == nil {
			j.mu.Lock()
			j.registered = true
			j.mu.Unlock()
			j.log.Info("joined the cluster", "member", j.m.Key(), "url", j.m.Record().URL, "cluster_uri", dc.ClusterURI,
				"heartbeat_interval_sec", dc.HeartbeatIntervalSec, "inactive_timeout_sec", dc.InactiveTimeoutSec)
			return
		}
		if ctx.Err() != nil || errors.Is(err, membership.ErrClosed) || errors.Is(err, membership.ErrInvalid) {
			if ctx.Err() == nil {
				j.log.Error("cannot join the cluster", "err", err)
			}
			return
		}
		if attempt%20 == 0 {
			j.log.Warn("cannot join the cluster yet, retrying", "cluster_uri", dc.ClusterURI, "err", err, "attempt", attempt+1)
		}
		pause.Reset(250 * time.Millisecond)
		select {
		case <-ctx.Done():
			return
		case <-pause.C:
		}
	}
}

// leave deregisters (within timeout) and closes the store; it reports
// whether the worker had registered.
func (j *joiner) leave(timeout time.Duration) bool {
	j.stop()
	<-j.done
	j.mu.Lock()
	was := j.registered
	j.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := j.m.Deregister(ctx); err != nil {
		j.log.Warn("deregistering failed: the lease ends by itself", "err", err)
	} else if was {
		j.log.Info("left the cluster", "member", j.m.Key())
	}
	j.store.Close()
	return was
}
