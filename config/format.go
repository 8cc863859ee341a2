package config

import (
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Format writes the effective configuration of f as YAML in the file's own
// form, every value commented with its source (default, file:line:col, env).
// Settings that come only from the environment are written as comments, so
// the output loads back (with the same environment) to the same values.
func (f *File) Format(w io.Writer) error {
	doc := &yaml.Node{Kind: yaml.MappingNode}
	switch f.Kind {
	case KindWorker:
		f.formatWorker(doc)
	case KindCluster:
		f.formatCluster(doc)
	default:
		return fmt.Errorf("config: format: file %s has no kind", f.Path)
	}
	enc := yaml.NewEncoder(w)
	enc.SetIndent(2)
	if err := enc.Encode(doc); err != nil {
		return fmt.Errorf("config: format %s: %w", f.Path, err)
	}
	return enc.Close()
}

func (f *File) formatWorker(m *yaml.Node) {
	wk := f.Worker
	f.addInt(m, "", "tensor_parallel_size", wk.TensorParallelSize)
	f.addInt(m, "", "pipeline_parallel_size", wk.PipelineParallelSize)
	f.addKVCache(m, "kv_cache_config", wk.KVCache)
	if wk.CacheTransceiver == nil {
		m.Content[0].HeadComment = "cache_transceiver_config: not set (no transceiver: disaggregated requests are refused)"
	} else {
		f.addCT(m, "cache_transceiver_config", wk.CacheTransceiver)
	}
	if wk.DisaggCluster != nil {
		f.addDisaggCluster(m, wk.DisaggCluster)
	}
	f.addSecurity(m, "security", &wk.Security)
}

func (f *File) formatCluster(m *yaml.Node) {
	cl := f.Cluster
	f.addScalar(m, "", "hostname", "!!str", cl.Hostname)
	f.addInt(m, "", "port", cl.Port)
	var left []string
	for _, g := range []struct {
		name string
		g    *ServerGroup
	}{{"context_servers", &cl.Context}, {"generation_servers", &cl.Generation}} {
		if cl.DisaggCluster != nil && reflect.DeepEqual(*g.g, dynamicGroup()) && f.Source(join(g.name, "num_instances")).Kind == SourceDefault {
			left = append(left, g.name)
			continue
		}
		gm := &yaml.Node{Kind: yaml.MappingNode}
		m.Content = append(m.Content, key(g.name), gm)
		f.formatGroup(gm, g.name, g.g)
	}
	if len(left) > 0 {
		m.Content[len(m.Content)-2].FootComment = strings.Join(left, ", ") + ": not in the file; the workers are to register through disagg_cluster"
	}
	if cd := cl.ConditionalDisagg; cd != nil {
		cm := &yaml.Node{Kind: yaml.MappingNode}
		m.Content = append(m.Content, key(keyConditionalDisagg), cm)
		f.addInt(cm, keyConditionalDisagg, "max_local_prefill_length", cd.MaxLocalPrefillLength)
		cm.Content[0].HeadComment = "the router asks the chosen generation worker how much of the prompt it has cached; at most this many tokens left to compute (and some cached): prefilled there, no context worker"
	}
	if cl.DisaggCluster != nil {
		f.addDisaggCluster(m, cl.DisaggCluster)
	}
	f.addSecurity(m, "security", &cl.Security)
}

// formatGroup writes one server group into gm.
func (f *File) formatGroup(gm *yaml.Node, name string, g *ServerGroup) {
	var notes []string
	f.addInt(gm, name, "num_instances", g.NumInstances)
	f.addInt(gm, name, "tensor_parallel_size", g.TensorParallelSize)
	f.addInt(gm, name, "pipeline_parallel_size", g.PipelineParallelSize)
	if len(g.URLs) > 0 {
		seq := &yaml.Node{Kind: yaml.SequenceNode, Style: yaml.FlowStyle, LineComment: f.Source(join(name, "urls")).String()}
		for _, u := range g.URLs {
			seq.Content = append(seq.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: u})
		}
		gm.Content = append(gm.Content, key("urls"), seq)
	} else {
		notes = append(notes, "urls: none (kvxfer up picks free ports; kvxfer router needs them)")
	}
	rm := &yaml.Node{Kind: yaml.MappingNode}
	gm.Content = append(gm.Content, key("router"), rm)
	f.addScalar(rm, join(name, "router"), "type", "!!str", g.Router)
	rp := join(name, "router")
	switch g.Router {
	case RouterKVCacheAware:
		f.addInt(rm, rp, "max_batch_size", g.RouterArgs.MaxBatchSize)
		rm.Content[len(rm.Content)-1].LineComment += "; prefix blocks hashed with kv_cache_config.tokens_per_block " + strconv.Itoa(g.KVCache.TokensPerBlock)
	case RouterConversation:
		f.addInt(rm, rp, "max_sessions", g.RouterArgs.MaxSessions)
		f.addInt(rm, rp, "tokens_per_block", g.RouterArgs.TokensPerBlock)
		f.addScalar(rm, rp, "match_threshold", "!!float", strconv.FormatFloat(g.RouterArgs.MatchThreshold, 'g', -1, 64))
		f.addInt(rm, rp, "hash_skip_count", g.RouterArgs.HashSkipCount)
	}
	f.addKVCache(gm, join(name, "kv_cache_config"), g.KVCache)
	if g.CacheTransceiver != nil {
		f.addCT(gm, join(name, "cache_transceiver_config"), g.CacheTransceiver)
	} else {
		notes = append(notes, "cache_transceiver_config: not set (the workers bring their own worker files; kvxfer up uses backend DEFAULT)")
	}
	if len(notes) > 0 {
		gm.Content[0].HeadComment = strings.Join(notes, "\n")
	}
}

// addDisaggCluster writes a disagg_cluster block.
func (f *File) addDisaggCluster(m *yaml.Node, dc *DisaggCluster) {
	p := keyDisaggCluster
	dm := &yaml.Node{Kind: yaml.MappingNode}
	m.Content = append(m.Content, key(p), dm)
	f.addScalar(dm, p, "cluster_uri", "!!str", dc.ClusterURI)
	if dc.ClusterName != "" {
		f.addScalar(dm, p, "cluster_name", "!!str", dc.ClusterName)
	}
	mm := &yaml.Node{Kind: yaml.MappingNode}
	dm.Content = append(dm.Content, key("minimal_instances"), mm)
	f.addInt(mm, join(p, "minimal_instances"), "context_servers", dc.MinContext)
	f.addInt(mm, join(p, "minimal_instances"), "generation_servers", dc.MinGeneration)
	f.addInt(dm, p, "heartbeat_interval_sec", dc.HeartbeatIntervalSec)
	f.addInt(dm, p, "inactive_timeout_sec", dc.InactiveTimeoutSec)
}

func (f *File) addKVCache(m *yaml.Node, path string, kv KVCache) {
	km := &yaml.Node{Kind: yaml.MappingNode}
	m.Content = append(m.Content, key(lastElem(path)), km)
	f.addInt(km, path, "tokens_per_block", kv.TokensPerBlock)
	f.addInt(km, path, "max_tokens", kv.MaxTokens)
	// The reuse keys print only when set (unset means TensorRT-LLM's
	// default, and must stay unset through a round trip), the event buffer
	// only when it keeps events.
	for _, b := range []struct {
		key string
		v   *bool
	}{{"enable_block_reuse", kv.EnableBlockReuse}, {"enable_partial_reuse", kv.EnablePartialReuse}, {"copy_on_partial_reuse", kv.CopyOnPartialReuse}} {
		if b.v != nil {
			f.addScalar(km, path, b.key, "!!bool", strconv.FormatBool(*b.v))
		}
	}
	if kv.EventBufferMaxSize > 0 {
		f.addInt(km, path, "event_buffer_max_size", kv.EventBufferMaxSize)
	}
}

func (f *File) addCT(m *yaml.Node, path string, ct *CacheTransceiver) {
	cm := &yaml.Node{Kind: yaml.MappingNode}
	m.Content = append(m.Content, key(lastElem(path)), cm)
	if ct.Backend != BackendUnset {
		f.addScalar(cm, path, "backend", "!!str", string(ct.Backend))
	}
	if ct.MaxTokensInBuffer > 0 {
		f.addInt(cm, path, "max_tokens_in_buffer", ct.MaxTokensInBuffer)
	}
	f.addInt(cm, path, "kv_transfer_timeout_ms", ct.KVTransferTimeoutMs)
	if ct.SenderFutureTimeoutMs > 0 {
		f.addInt(cm, path, keySenderTimeout, ct.SenderFutureTimeoutMs)
	}
	if ct.Runtime != "" {
		f.addScalar(cm, path, keyRuntime, "!!str", ct.Runtime)
		cm.Content[len(cm.Content)-1].LineComment += "; not applicable to kvxfer"
	}
	src := func(field string) string { return f.Source(join(path, field)).String() }
	var foot []string
	if ct.MaxTokensInBuffer == 0 {
		foot = append(foot, fmt.Sprintf("max_tokens_in_buffer: unset, staging buffers are %d bytes each (%s %s)",
			ct.TransferBufferSize, EnvTransferBuffer, src("transfer_buffer_size")))
	}
	foot = append(foot,
		fmt.Sprintf("send buffers: %d (%s)", ct.SendBuffers, src("send_buffers")),
		fmt.Sprintf("receive buffers: %d (%s)", ct.RecvBuffers, src("recv_buffers")),
		fmt.Sprintf("zero-copy for identical layouts: %v (%s)", ct.ZeroCopy, src("zero_copy")))
	if ct.TimeOutputPath != "" {
		foot = append(foot, fmt.Sprintf("timing CSV directory: %s (%s)", ct.TimeOutputPath, src("time_output_path")))
	}
	if ct.UCXInterface != "" {
		foot = append(foot, fmt.Sprintf("UCX listener and side channel interface: %s (%s)", ct.UCXInterface, src("ucx_interface")))
	}
	// A head comment on the mapping's first key renders inside the mapping
	// at its indentation; yaml.v3 misplaces foot comments of nested maps.
	cm.Content[0].HeadComment = "from the environment:\n" + strings.Join(foot, "\n")
}

func (f *File) addInt(m *yaml.Node, prefix, k string, v int) {
	f.addScalar(m, prefix, k, "!!int", strconv.Itoa(v))
}

func (f *File) addScalar(m *yaml.Node, prefix, k, tag, v string) {
	m.Content = append(m.Content, key(k), &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: v,
		LineComment: f.Source(join(prefix, k)).String()})
}

func key(k string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: k} }

func lastElem(path string) string {
	for i := len(path) - 1; i >= 0; i-- {
		if path[i] == '.' {
			return path[i+1:]
		}
	}
	return path
}
