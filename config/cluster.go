package config

import (
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// cluster loads the cluster file form.
//
// As in TensorRT-LLM, every top-level key that is not a cluster key
// (clusterKeys) is an LLM API option of both server groups, and a group's
// own value of the key wins. The merge is per key: a group's own
// kv_cache_config replaces the top-level one as a whole. kvxfer reads the
// merged options it knows (llmKeys, and the group keys num_instances, urls
// and router), recording each value's source under the group's path with
// the note "top level"; the others are reported once, at the top level.
func (l *loader) cluster(root *yaml.Node, env Env) *Cluster {
	cl := defaultCluster()
	top := entries{}
	var secNode *yaml.Node
	groupNodes := map[string]*yaml.Node{}
	read := map[string]func(k, v *yaml.Node){
		"security": func(k, v *yaml.Node) { secNode = v },
		"hostname": func(k, v *yaml.Node) {
			if l.str(v, "hostname", &cl.Hostname) && strings.TrimSpace(cl.Hostname) == "" {
				l.errAt(v, "hostname", "must not be empty")
			}
		},
		"port":               func(k, v *yaml.Node) { l.integer(v, "port", &cl.Port, 1, 65535) },
		"context_servers":    func(k, v *yaml.Node) { groupNodes["context_servers"] = v },
		"generation_servers": func(k, v *yaml.Node) { groupNodes["generation_servers"] = v },
		keyConditionalDisagg: func(k, v *yaml.Node) { cl.ConditionalDisagg = l.conditionalDisagg(k, v) },
		keyDisaggCluster:     func(k, v *yaml.Node) { cl.DisaggCluster = l.disaggCluster(k, v, keyDisaggCluster) },
	}
	top.collect(read, append(slices.Clone(llmKeys), groupKeys...), true)
	l.fields(root, "", read, append(slices.Clone(clusterKnown), llmAPIKnown...), false)
	cl.Security = l.security(secNode, "security", env)
	for _, g := range []struct {
		name string
		g    *ServerGroup
	}{{"context_servers", &cl.Context}, {"generation_servers", &cl.Generation}} {
		n, ok := groupNodes[g.name]
		switch {
		case ok:
			l.serverGroup(n, g.name, g.g, top, env)
			l.conflicts(root, n, g.name)
		case cl.DisaggCluster != nil:
			// The workers register themselves.
			*g.g = dynamicGroup()
		default:
			*g.g = defaultServerGroup()
			l.c.add(SevError, 0, 0, g.name, "missing: a cluster file needs both context_servers and generation_servers (or disagg_cluster)")
		}
	}
	return cl
}

// serverGroup loads context_servers or generation_servers, with the options
// it takes from the top level (top).
func (l *loader) serverGroup(n *yaml.Node, path string, g *ServerGroup, top entries, env Env) {
	*g = defaultServerGroup()
	own := entries{}
	if l.mapping(n, path) { // null: an empty group, as in TensorRT-LLM
		read := map[string]func(k, v *yaml.Node){}
		own.collect(read, append(slices.Clone(llmKeys), groupKeys...), false)
		l.fields(n, path, read, llmAPIKnown, false)
	}
	for k, e := range top {
		if _, ok := own[k]; !ok {
			own[k] = e
		}
	}
	if e, ok := own["num_instances"]; ok {
		l.with(e, path, "num_instances", func(p string) { l.integer(e.val, p, &g.NumInstances, 0, MaxParallel) })
	}
	if e, ok := own["router"]; ok {
		l.with(e, path, "router", func(p string) { l.router(e.val, p, g) })
	}
	var urls entry
	if e, ok := own["urls"]; ok {
		urls = e
		l.with(e, path, "urls", func(p string) { l.urls(e.val, p, g) })
	}
	g.CacheTransceiver = l.options(own, path, parallel{&g.TensorParallelSize, &g.PipelineParallelSize, &g.KVCache}, env)
	if block, _, _ := g.KVCache.Reuse(); g.Router == RouterKVCacheAware && (!block || g.KVCache.EventBufferMaxSize == 0) {
		p := join(join(path, "router"), "type")
		l.c.warn("", l.src[p].Line, l.src[p].Col, p,
			"kv_cache_aware reads the workers' KV cache events, but this group's kv_cache_config has %s: the router sees no cached blocks and routes by load alone",
			map[bool]string{true: "event_buffer_max_size 0 (no events kept)", false: "enable_block_reuse false"}[block])
	}
	if urls.val != nil && len(g.URLs) > 0 && len(g.URLs) != g.NumInstances {
		l.errAt(urls.val, join(path, "urls"), "has %d entries but num_instances is %d; give one host:port per instance", len(g.URLs), g.NumInstances)
	}
	if path == "context_servers" && g.NumInstances == 0 {
		line, col := l.src[join(path, "num_instances")].Line, l.src[join(path, "num_instances")].Col
		l.c.warn("", line, col, join(path, "num_instances"),
			"0: TensorRT-LLM's generation-only benchmark mode; the file loads, kvxfer router and kvxfer up refuse to start without context workers")
	}
}

// urls loads a server group's urls, each host:port. Each is checked, and
// named, at its own place in the list: g.URLs holds only the strings,
// which an entry strList refused would shift.
func (l *loader) urls(n *yaml.Node, path string, g *ServerGroup) {
	l.strList(n, path, &g.URLs)
	if n.Kind != yaml.SequenceNode || len(n.Content) > MaxParallel {
		return
	}
	for i, e := range n.Content {
		e = deref(e)
		if e.Kind != yaml.ScalarNode || e.Tag != "!!str" {
			continue // strList has said why
		}
		if err := checkHostPort(e.Value); err != nil {
			l.errAt(e, fmt.Sprintf("%s[%d]", path, i), "%v", err)
		}
	}
}

func checkHostPort(u string) error {
	s := strings.TrimPrefix(strings.TrimPrefix(u, "http://"), "https://")
	i := strings.LastIndexByte(s, ':')
	if i <= 0 {
		return fmt.Errorf("%q is not host:port", u)
	}
	p, err := strconv.Atoi(s[i+1:])
	if err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("%q has no valid port (1..65535)", u)
	}
	return nil
}

// router loads a server group's router block. TensorRT-LLM matches the type
// in any case; the other keys are its policies' arguments.
func (l *loader) router(n *yaml.Node, path string, g *ServerGroup) {
	l.block(n, path, map[string]func(k, v *yaml.Node){
		"type": func(k, v *yaml.Node) {
			p := join(path, "type")
			var s string
			if !l.str(v, p, &s) {
				return
			}
			switch t := strings.ToLower(strings.TrimSpace(s)); t {
			case RouterRoundRobin, RouterLoadBalancing, RouterKVCacheAware, RouterConversation:
				g.Router = t
			default:
				l.errAt(v, p, "unknown router type %q (valid: %s, %s, %s, %s)",
					s, RouterRoundRobin, RouterLoadBalancing, RouterKVCacheAware, RouterConversation)
			}
		},
		"max_batch_size":   l.intKey(path, "max_batch_size", &g.RouterArgs.MaxBatchSize, 1, 1<<20),
		"tokens_per_block": l.intKey(path, "tokens_per_block", &g.RouterArgs.TokensPerBlock, 1, MaxTokensPerBlock),
		"max_sessions":     l.intKey(path, "max_sessions", &g.RouterArgs.MaxSessions, 1, 1<<24),
		"hash_skip_count":  l.intKey(path, "hash_skip_count", &g.RouterArgs.HashSkipCount, 0, MaxPoolTokens),
		"match_threshold": func(k, v *yaml.Node) {
			p := join(path, "match_threshold")
			var f float64
			if v.Kind != yaml.ScalarNode || (v.Tag != "!!float" && v.Tag != "!!int") || v.Decode(&f) != nil {
				l.errAt(v, p, "want a number in (0, 1], got %s", describeNode(v))
				return
			}
			if !(f > 0 && f <= 1) {
				l.errAt(v, p, "%v is out of range (0, 1]", f)
				return
			}
			g.RouterArgs.MatchThreshold = f
			l.mark(v, p)
		},
	}, routerKnown, false)
}

// conflicts warns about each key a server group sets with a value other
// than the top level's: kvxfer uses the group's, where TensorRT-LLM refuses
// the file.
func (l *loader) conflicts(root, group *yaml.Node, path string) {
	if group.Kind != yaml.MappingNode {
		return
	}
	for i := 0; i+1 < len(group.Content); i += 2 {
		k := group.Content[i]
		if slices.Contains(clusterKeys, k.Value) {
			continue
		}
		for j := 0; j+1 < len(root.Content); j += 2 {
			if root.Content[j].Value == k.Value && !sameValue(root.Content[j+1], group.Content[i+1]) {
				l.c.warn("", k.Line, k.Column, join(path, k.Value),
					"also set at the top level (line %d) with another value: kvxfer uses this group's value (TensorRT-LLM refuses such a file)", root.Content[j].Line)
			}
		}
	}
}

// sameValue reports whether two nodes hold the same data.
func sameValue(a, b *yaml.Node) bool {
	var x, y any
	if a.Decode(&x) != nil || b.Decode(&y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

// conditionalDisagg loads conditional_disagg_config (strict, as
// TensorRT-LLM's dataclass is).
func (l *loader) conditionalDisagg(k, n *yaml.Node) *ConditionalDisagg {
	path := keyConditionalDisagg
	cd := &ConditionalDisagg{}
	if !l.block(n, path, map[string]func(k, v *yaml.Node){
		"max_local_prefill_length": l.intKey(path, "max_local_prefill_length", &cd.MaxLocalPrefillLength, 0, MaxPoolTokens),
	}, nil, true) {
		return nil
	}
	return cd
}

// disaggCluster loads a disagg_cluster block (strict: TensorRT-LLM refuses
// unknown keys here too).
func (l *loader) disaggCluster(k, n *yaml.Node, path string) *DisaggCluster {
	dc := &DisaggCluster{MinContext: 1, MinGeneration: 1, HeartbeatIntervalSec: 5, InactiveTimeoutSec: 10}
	var uri *yaml.Node
	if !l.block(n, path, map[string]func(k, v *yaml.Node){
		"cluster_uri": func(k, v *yaml.Node) {
			uri = k
			p := join(path, "cluster_uri")
			if l.str(v, p, &dc.ClusterURI) {
				if _, err := ParseClusterURI(dc.ClusterURI); err != nil {
					l.errAt(v, p, "%v", err)
				}
			}
		},
		"cluster_name": func(k, v *yaml.Node) {
			p := join(path, "cluster_name")
			if l.str(v, p, &dc.ClusterName) {
				if err := CheckClusterName(dc.ClusterName); err != nil {
					l.errAt(v, p, "%v", err)
				}
			}
		},
		"minimal_instances": func(k, v *yaml.Node) {
			p := join(path, "minimal_instances")
			l.block(v, p, map[string]func(k, v *yaml.Node){
				"context_servers":    l.intKey(p, "context_servers", &dc.MinContext, 0, MaxParallel),
				"generation_servers": l.intKey(p, "generation_servers", &dc.MinGeneration, 0, MaxParallel),
			}, nil, true)
		},
		"heartbeat_interval_sec": l.intKey(path, "heartbeat_interval_sec", &dc.HeartbeatIntervalSec, 1, 3600),
		"inactive_timeout_sec":   l.intKey(path, "inactive_timeout_sec", &dc.InactiveTimeoutSec, 1, 3600),
		// TensorRT-LLM's README writes inactive_interval_sec, which its
		// loader refuses: say which key it means.
		"inactive_interval_sec": func(k, v *yaml.Node) {
			l.errAt(k, join(path, k.Value), "unknown key: TensorRT-LLM's README writes it, but its loader refuses it too; the key is inactive_timeout_sec")
		},
	}, nil, true) {
		return nil
	}
	if uri == nil {
		l.errAt(n, join(path, "cluster_uri"), "missing: disagg_cluster needs cluster_uri (http://host:port or etcd://host:port)")
	}
	if err := CheckHeartbeat(dc.HeartbeatIntervalSec, dc.InactiveTimeoutSec); err != nil {
		at := n
		if s, ok := l.src[join(path, "heartbeat_interval_sec")]; ok && s.Kind == SourceFile {
			at = &yaml.Node{Line: s.Line, Column: s.Col}
		}
		l.errAt(at, join(path, "heartbeat_interval_sec"), "%v", err)
	}
	return dc
}
