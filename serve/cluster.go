package serve

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/kvxfer/kvxfer/membership"
)

// ClusterOptions are a router's dynamic membership (TensorRT-LLM's
// disagg_cluster): the workers register themselves in Store, and the
// router routes to them besides the static urls of RouterOptions.
//
// Liveness has two tiers. The lease is the truth: a worker whose lease
// ended or that deregistered leaves its group. In addition, the router's
// local mark-down works for members as for static urls: a request or a
// health probe to a worker that fails (connection refused or reset, a
// missed deadline) marks it down at once, so that it is tried last and
// probed until it answers, long before its lease can expire.
type ClusterOptions struct {
	// Store is the membership store (the caller opens and closes it).
	Store membership.Store
	// Name is cluster_name.
	Name string
	// MinContext and MinGeneration are minimal_instances: below either,
	// the router answers 503 naming the missing role.
	MinContext, MinGeneration int
	// Handler, when set, is the built-in store's HTTP handler
	// (memstore.Handler, for an http:// cluster_uri): the router serves it
	// under memstore.BasePath on its own listener.
	Handler http.Handler
	// URI is cluster_uri, shown in /cluster_info.
	URI string
	// Accept, when set, is the view's filter of the records the router
	// may route to (membership.ViewOptions.Accept).
	Accept func(*membership.Record) error
}

// routerCluster is a router's membership state.
type routerCluster struct {
	opts    ClusterOptions
	view    *membership.View
	handler http.Handler
}

// startCluster starts watching the membership; Close stops it.
func (r *Router) startCluster(o ClusterOptions) {
	c := &routerCluster{opts: o, handler: o.Handler}
	c.view = membership.NewView(o.Store, membership.ViewOptions{Cluster: o.Name, Logger: r.log, Accept: o.Accept,
		OnChange: func(changes []membership.Change) { r.syncMembers(changes) }})
	r.cluster = c
	r.probes.Add(1)
	go func() {
		defer r.probes.Done()
		c.view.Run(r.life) //nolint:errcheck // ends with Close, or when the store is closed
	}()
}

// syncMembers makes each group's dynamic servers the view's workers of its
// role: a joined worker is routable at once, a worker that left is no
// longer routed to (its probes stop). A worker keeps its upstream (and so
// its in-flight count and its mark-down) across updates of its record.
func (r *Router) syncMembers(changes []membership.Change) {
	for _, c := range changes {
		r.log.Info("cluster membership: worker "+c.Kind.String(), "role", string(c.Worker.Record.Role), "url", c.Worker.Record.URL,
			"member", c.Worker.ID, "model", c.Worker.Record.Model, "layout_fingerprint", c.Worker.Record.LayoutFingerprint)
	}
	for _, gr := range []struct {
		g    *group
		role membership.Role
	}{{r.prefill, membership.RoleContext}, {r.gen, membership.RoleGeneration}} {
		members := r.cluster.view.Workers(gr.role)
		gr.g.mu.Lock()
		byURL := map[string]*upstream{}
		var next []*upstream
		for _, s := range gr.g.servers {
			if s.member.Load() == nil { // static
				next = append(next, s)
				byURL[s.url] = s
			}
		}
		old := map[string]*upstream{}
		for _, s := range gr.g.servers {
			if s.member.Load() != nil {
				old[s.url] = s
			}
		}
		for _, m := range members {
			u, err := upstreamURL(m.Record.URL, r.tls)
			if err != nil {
				r.warn("member-url:"+m.Key, "cluster membership: a worker's url cannot be routed to: ignored", "member", m.Key, "err", err)
				continue
			}
			if _, ok := byURL[u]; ok {
				continue // a static url, or twice
			}
			info := m
			s := old[u]
			if s == nil {
				s = newUpstream(u)
			}
			delete(old, u)
			s.member.Store(&info)
			byURL[u] = s
			next = append(next, s)
		}
		for _, s := range old {
			s.removed.Store(true)
			if gr.g.conv != nil {
				gr.g.conv.forget(s.url)
			}
		}
		gr.g.servers = next
		gr.g.mu.Unlock()
	}
	r.updateWorkerGauge()
}

// updateWorkerGauge sets kvxfer_router_workers{role,state}.
func (r *Router) updateWorkerGauge() {
	for _, g := range []*group{r.prefill, r.gen} {
		up, down := 0, 0
		for _, s := range g.list() {
			if s.down.Load() {
				down++
			} else {
				up++
			}
		}
		r.m.Workers.WithLabelValues(g.name, "up").Set(float64(up))
		r.m.Workers.WithLabelValues(g.name, "down").Set(float64(down))
	}
}

// ready reports whether each group has at least minimal_instances workers
// (static urls and members, marked down or not: minimal_instances counts
// the workers that are in the cluster); if not, the role short and why.
func (r *Router) ready() (bool, string, string) {
	if r.cluster == nil {
		return true, "", ""
	}
	for _, g := range []struct {
		g        *group
		min      int
		minimal  string
		upstream string
	}{{r.prefill, r.cluster.opts.MinContext, "context_servers", "context"}, {r.gen, r.cluster.opts.MinGeneration, "generation_servers", "generation"}} {
		if n := len(g.g.list()); n < g.min {
			return false, g.upstream, fmt.Sprintf("cluster %q is not ready: %d of the %d %s workers minimal_instances.%s asks for have registered",
				r.cluster.opts.Name, n, g.min, g.upstream, g.minimal)
		}
	}
	return true, "", ""
}

// notReadyError is the router's 503 while the cluster is below
// minimal_instances: an OpenAI-style error that names the missing role.
type notReadyError struct {
	Error struct {
		Message     string `json:"message"`
		Type        string `json:"type"`
		Code        int    `json:"code"`
		MissingRole string `json:"missing_role"`
	} `json:"error"`
}

func writeNotReady(w http.ResponseWriter, role, why string) {
	var e notReadyError
	e.Error.Message, e.Error.Type, e.Error.Code, e.Error.MissingRole = why, "cluster_not_ready", http.StatusServiceUnavailable, role
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Retry-After", "1")
	w.WriteHeader(http.StatusServiceUnavailable)
	json.NewEncoder(w).Encode(e)
}

// ClusterWorker is one worker in /cluster_info: TensorRT-LLM's worker_id,
// host, port and role, and kvxfer's own fields.
type ClusterWorker struct {
	WorkerID   string `json:"worker_id,omitempty"` // the member id of a registered worker
	Host       string `json:"host"`
	Port       int    `json:"port"`
	Role       string `json:"role"` // context or generation
	URL        string `json:"url"`
	Static     bool   `json:"static"` // from the cluster file's urls, not registered
	MarkedDown bool   `json:"marked_down"`
	DownReason string `json:"down_reason,omitempty"`
	DownSince  string `json:"down_since,omitempty"`
	// Of a registered worker:
	Model             string   `json:"model,omitempty"`
	TP                int      `json:"tp,omitempty"`
	PP                int      `json:"pp,omitempty"`
	DP                int      `json:"dp,omitempty"`
	LayoutFingerprint string   `json:"layout_fingerprint,omitempty"`
	Backends          []string `json:"backends,omitempty"`
	RegisteredAt      string   `json:"registered_at,omitempty"`
	AgeSec            float64  `json:"age_sec,omitempty"`
}

// ClusterInfo is the router's /cluster_info (and the "cluster" member of
// /health with disagg_cluster): readiness as TensorRT-LLM's is_ready, the
// minimal_instances, and the current workers of each role.
type ClusterInfo struct {
	IsReady          bool                       `json:"is_ready"`
	Reason           string                     `json:"reason,omitempty"`
	MissingRole      string                     `json:"missing_role,omitempty"`
	ClusterName      string                     `json:"cluster_name,omitempty"`
	ClusterURI       string                     `json:"cluster_uri,omitempty"`
	Dynamic          bool                       `json:"dynamic"` // disagg_cluster is on
	Synced           bool                       `json:"synced"`  // the membership watch is live
	MinimalInstances map[string]int             `json:"minimal_instances,omitempty"`
	CurrentWorkers   map[string][]ClusterWorker `json:"current_workers"`
}

// clusterState is the router's ClusterInfo now.
func (r *Router) clusterState() ClusterInfo {
	ok, role, why := r.ready()
	ci := ClusterInfo{IsReady: ok, Reason: why, MissingRole: role, CurrentWorkers: map[string][]ClusterWorker{}}
	if c := r.cluster; c != nil {
		ci.Dynamic, ci.ClusterName, ci.ClusterURI, ci.Synced = true, c.opts.Name, c.opts.URI, c.view.Stats().Synced
		ci.MinimalInstances = map[string]int{"context_servers": c.opts.MinContext, "generation_servers": c.opts.MinGeneration}
	}
	now := time.Now()
	for _, g := range []struct {
		g    *group
		name string
	}{{r.prefill, "context_servers"}, {r.gen, "generation_servers"}} {
		ws := []ClusterWorker{}
		for _, s := range g.g.list() {
			m := s.member.Load()
			cw := ClusterWorker{URL: s.url, Static: m == nil, Role: g.g.name}
			if u, err := url.Parse(s.url); err == nil {
				cw.Host = u.Hostname()
				cw.Port, _ = strconv.Atoi(u.Port())
			}
			if down, why, since := s.state(); down {
				cw.MarkedDown, cw.DownReason, cw.DownSince = true, why, since.UTC().Format(time.RFC3339Nano)
			}
			if m != nil {
				rec := m.Record
				cw.WorkerID, cw.Model, cw.LayoutFingerprint, cw.Backends = m.ID, rec.Model, rec.LayoutFingerprint, slices.Clone(rec.Backends)
				cw.TP, cw.PP, cw.DP = rec.Layout.TP, rec.Layout.PP, rec.Layout.DP
				if !rec.RegisteredAt.IsZero() {
					cw.RegisteredAt = rec.RegisteredAt.UTC().Format(time.RFC3339Nano)
					cw.AgeSec = now.Sub(rec.RegisteredAt).Round(time.Millisecond).Seconds()
				}
			}
			ws = append(ws, cw)
		}
		ci.CurrentWorkers[g.name] = ws
	}
	return ci
}

// ClusterInfo returns what /cluster_info shows.
func (r *Router) ClusterInfo() ClusterInfo { return r.clusterState() }

// clusterInfo serves /cluster_info: 200 with ClusterInfo (is_ready says
// whether the router routes).
func (r *Router) clusterInfo(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(r.clusterState())
}
