package connect

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/etcdstore"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

// Options are the connections' settings beyond the block.
type Options struct {
	// HTTPClient reaches an http(s):// store (the router's built-in
	// one); nil: a client of the store's own. Give one with the TLS
	// config for https.
	HTTPClient *http.Client
	// Token is the built-in store's bearer token, if it wants one.
	Token string
	// Etcd are the etcd client's settings.
	Etcd etcdstore.Options
	// EtcdClient is the security.etcd block: for an etcd:// cluster_uri,
	// Open loads its TLS files and password into Etcd.
	EtcdClient config.EtcdClient
}

// Open returns a client of the store dc.ClusterURI names: etcdstore for
// etcd://, a memstore.Client for http(s)://. The caller closes it. For
// etcd it connects (and starts the client's goroutines); for http it
// dials nothing until the first call.
func Open(ctx context.Context, dc config.DisaggCluster, opts Options) (membership.Store, error) {
	u, err := config.ParseClusterURI(dc.ClusterURI)
	if err != nil {
		return nil, fmt.Errorf("membership: cluster_uri: %w", err)
	}
	switch u.Scheme {
	case config.SchemeEtcd:
		if opts.EtcdClient != (config.EtcdClient{}) {
			eo, err := EtcdOptions(opts.EtcdClient)
			if err != nil {
				return nil, fmt.Errorf("membership: %w", err)
			}
			eo.DialTimeout, eo.KeepAliveTime, eo.KeepAliveTimeout, eo.MaxList =
				opts.Etcd.DialTimeout, opts.Etcd.KeepAliveTime, opts.Etcd.KeepAliveTimeout, opts.Etcd.MaxList
			opts.Etcd = eo
		}
		return etcdstore.Dial(ctx, u.Endpoints, opts.Etcd)
	default:
		return memstore.NewClient(u.Scheme+"://"+u.Endpoints[0], memstore.ClientOptions{HTTPClient: opts.HTTPClient, Token: opts.Token})
	}
}

// EtcdOptions are the etcd client's settings of a security.etcd block:
// its TLS files loaded (errors name the file and what is wrong with it)
// and its user's password read. The zero block gives the zero Options.
func EtcdOptions(e config.EtcdClient) (etcdstore.Options, error) {
	var o etcdstore.Options
	if e.TLS() {
		c, err := tlsconf.LoadClient(e.CAFile, e.CertFile, e.KeyFile)
		if err != nil {
			return o, fmt.Errorf("security.etcd: %w", err)
		}
		o.TLS = c
	}
	if e.Username != "" {
		pw, err := e.LoadPassword()
		if err != nil {
			return o, err
		}
		o.Username, o.Password = e.Username, pw
	}
	return o, nil
}

// IsBuiltIn reports whether dc names the built-in store (http:// or
// https://), which the router serves itself with memstore.Handler.
func IsBuiltIn(dc config.DisaggCluster) bool {
	u, err := config.ParseClusterURI(dc.ClusterURI)
	return err == nil && u.Scheme != config.SchemeEtcd
}

// MemberOptions are a worker's registration settings from dc:
// heartbeat_interval_sec and inactive_timeout_sec (the lease's TTL).
func MemberOptions(dc config.DisaggCluster) membership.MemberOptions {
	return membership.MemberOptions{
		Cluster:  dc.ClusterName,
		Interval: time.Duration(dc.HeartbeatIntervalSec) * time.Second,
		TTL:      time.Duration(dc.InactiveTimeoutSec) * time.Second,
	}
}

// ViewOptions are the router's view settings from dc.
func ViewOptions(dc config.DisaggCluster) membership.ViewOptions {
	return membership.ViewOptions{Cluster: dc.ClusterName}
}

// Ready reports whether the view holds at least minimal_instances of each
// role, and if not, which role is short: the router answers 503 naming it.
func Ready(v *membership.View, dc config.DisaggCluster) (bool, string) {
	c, g := len(v.Workers(membership.RoleContext)), len(v.Workers(membership.RoleGeneration))
	switch {
	case c < dc.MinContext:
		return false, fmt.Sprintf("%d of the %d context workers minimal_instances asks for", c, dc.MinContext)
	case g < dc.MinGeneration:
		return false, fmt.Sprintf("%d of the %d generation workers minimal_instances asks for", g, dc.MinGeneration)
	}
	return true, ""
}

// Token is the built-in store's bearer token of a cluster secret: an HMAC
// of a fixed label under the secret (hex), so that the secret itself never
// travels in a header. The router's store and its workers derive the same
// one; "" for no secret.
func Token(secret []byte) string {
	if len(secret) == 0 {
		return ""
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("kvxfer membership store token v1"))
	return hex.EncodeToString(m.Sum(nil))
}
