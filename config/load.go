package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// MaxFileSize bounds the size of a config file; anything larger is refused
// before it is parsed.
const MaxFileSize = 1 << 20

// LoadFile reads and loads the config file at path with the environment
// snapshot env. See LoadBytes.
func LoadFile(path string, env Env) (*File, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fileError(path, describeOSError(err))
	}
	if fi.IsDir() {
		return nil, fileError(path, "is a directory, not a config file")
	}
	if !fi.Mode().IsRegular() && fi.Mode()&os.ModeNamedPipe == 0 {
		return nil, fileError(path, "is not a regular file")
	}
	fh, err := os.Open(path)
	if err != nil {
		return nil, fileError(path, describeOSError(err))
	}
	defer fh.Close()
	data, err := io.ReadAll(io.LimitReader(fh, MaxFileSize+1))
	if err != nil {
		return nil, fileError(path, describeOSError(err))
	}
	return LoadBytes(path, data, env)
}

func describeOSError(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return err.Error()
}

func fileError(path, msg string) error {
	return Problems{{Severity: SevError, File: path, Msg: msg}}
}

// LoadBytes loads one config file's content. name is used in messages.
// It tells the worker form from the cluster form by its keys
// (context_servers / generation_servers mean a cluster file), then applies
// defaults, the strict YAML, the environment and validation, in that order.
//
// On failure the error is a Problems listing every error; the returned File
// is then non-nil when the YAML could be read at all, so that warnings can
// still be shown.
func LoadBytes(name string, data []byte, env Env) (*File, error) {
	c := &collector{file: name}
	if len(data) > MaxFileSize {
		return nil, fileError(name, fmt.Sprintf("is larger than %d bytes; not a config file", MaxFileSize))
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, fileError(name, "is empty; a config file holds a YAML mapping")
	}
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		line, msg := yamlSyntaxError(err, data)
		return nil, Problems{{Severity: SevError, File: name, Line: line, Msg: msg}}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err != io.EOF {
		return nil, Problems{{Severity: SevError, File: name, Line: extra.Line, Msg: "holds more than one YAML document; a config file holds exactly one"}}
	}
	root := &doc
	if root.Kind == yaml.DocumentNode {
		if len(root.Content) == 0 {
			return nil, fileError(name, "is empty; a config file holds a YAML mapping")
		}
		root = root.Content[0]
	}
	root = deref(root)
	if root.Kind != yaml.MappingNode {
		if root.Kind == yaml.ScalarNode && root.Tag == "!!null" {
			return nil, fileError(name, "is empty; a config file holds a YAML mapping")
		}
		return nil, Problems{{Severity: SevError, File: name, Line: root.Line, Col: root.Column,
			Msg: fmt.Sprintf("the top level must be a mapping of keys to values, got %s", describeNode(root))}}
	}

	l := &loader{c: c, src: map[string]Source{}}
	f := &File{Path: name, Sources: l.src}
	if hasAnyKey(root, clusterMarkers) {
		f.Kind = KindCluster
		f.Cluster = l.cluster(root, env)
	} else {
		f.Kind = KindWorker
		f.Worker = l.worker(root, env)
	}
	dedupe(c)
	sort.SliceStable(c.problems, func(i, j int) bool { return c.problems[i].Line < c.problems[j].Line })
	f.Warnings = c.warnings()
	if errs := c.errs(); len(errs) > 0 {
		return f, errs
	}
	return f, nil
}

var yamlLineRE = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// yamlSyntaxError turns a yaml.v3 parse error into a line and a one-line
// message, with a plainer explanation for the usual mistakes.
func yamlSyntaxError(err error, data []byte) (int, string) {
	msg := strings.SplitN(err.Error(), "\n", 2)[0]
	line := 0
	if m := yamlLineRE.FindStringSubmatch(msg); m != nil {
		line, _ = strconv.Atoi(m[1])
		msg = m[2]
	}
	msg = strings.TrimPrefix(msg, "yaml: ")
	if line > 0 {
		lines := bytes.Split(data, []byte("\n"))
		// yaml.v3 reports some errors on the line after the culprit.
		for _, l := range []int{line, line - 1, line + 1} {
			if l >= 1 && l <= len(lines) && bytes.ContainsRune(leadingSpace(lines[l-1]), '\t') {
				return l, "tab character in indentation; YAML indents with spaces only"
			}
		}
	}
	if strings.Contains(msg, "invalid leading UTF-8 octet") || strings.Contains(msg, "control characters are not allowed") {
		msg = "not a YAML text file (" + msg + ")"
	}
	return line, "not valid YAML: " + msg
}

func leadingSpace(b []byte) []byte {
	i := 0
	for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
		i++
	}
	return b[:i]
}

func dedupe(c *collector) {
	seen := map[Problem]bool{}
	out := c.problems[:0]
	for _, p := range c.problems {
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	c.problems = out
}

func deref(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && i < 16; i++ {
		n = n.Alias
	}
	return n
}

func hasAnyKey(m *yaml.Node, keys []string) bool {
	for i := 0; i+1 < len(m.Content); i += 2 {
		for _, k := range keys {
			if m.Content[i].Value == k {
				return true
			}
		}
	}
	return false
}

func describeNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		switch n.Tag {
		case "!!null":
			return "null"
		case "!!str":
			return fmt.Sprintf("the string %q", truncate(n.Value))
		case "!!int":
			return "the integer " + truncate(n.Value)
		case "!!float":
			return "the number " + truncate(n.Value)
		case "!!bool":
			return "the boolean " + n.Value
		}
		return fmt.Sprintf("%s %q", strings.TrimPrefix(n.Tag, "!!"), truncate(n.Value))
	}
	return "an unexpected node"
}

func truncate(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

// loader walks yaml nodes into typed values, collecting problems and sources.
type loader struct {
	c   *collector
	src map[string]Source
}

func (l *loader) errAt(n *yaml.Node, path, format string, args ...any) {
	l.c.add(SevError, n.Line, n.Column, path, format, args...)
}

func (l *loader) mark(n *yaml.Node, path string) {
	l.src[path] = Source{Kind: SourceFile, File: l.c.file, Line: n.Line, Col: n.Column}
}

func join(prefix, key string) string {
	if prefix == "" {
		return key
	}
	return prefix + "." + key
}

// fields walks mapping m: each key in used is handed to its function, keys
// in ignored produce a warning, anything else an error with a suggestion.
// Duplicate keys are errors. m must already be a mapping.
func (l *loader) fields(m *yaml.Node, prefix string, used map[string]func(key, val *yaml.Node), ignored []string) {
	seen := map[string]*yaml.Node{}
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], deref(m.Content[i+1])
		path := join(prefix, k.Value)
		if k.Kind != yaml.ScalarNode {
			l.errAt(k, prefix, "keys must be plain names, got %s", describeNode(k))
			continue
		}
		if k.Value == "<<" {
			l.errAt(k, path, "YAML merge keys (<<) are not supported in kvxfer configs; write the keys out")
			continue
		}
		if first, dup := seen[k.Value]; dup {
			l.errAt(k, path, "duplicate key (first defined at line %d)", first.Line)
			continue
		}
		seen[k.Value] = k
		if fn, ok := used[k.Value]; ok {
			fn(k, v)
			continue
		}
		if contains(ignored, k.Value) {
			l.c.add(SevWarning, k.Line, k.Column, path, "known TensorRT-LLM key, ignored: it has no effect in kvxfer")
			continue
		}
		known := make([]string, 0, len(used)+len(ignored))
		for u := range used {
			known = append(known, u)
		}
		known = append(known, ignored...)
		if s := suggest(k.Value, known); s != "" {
			l.errAt(k, path, "unknown key; did you mean %q?", s)
		} else {
			l.errAt(k, path, "unknown key (valid here: %s)", strings.Join(sortedKeys(used), ", "))
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// mapping checks that n is a mapping (null counts as an empty one).
func (l *loader) mapping(n *yaml.Node, path string) bool {
	if n.Kind == yaml.MappingNode {
		return true
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return false
	}
	l.errAt(n, path, "want a mapping of keys to values, got %s", describeNode(n))
	return false
}

// integer decodes n into *dst when it is an integer in [lo, hi]. A null
// value leaves *dst unchanged (unset). It reports whether *dst was set.
func (l *loader) integer(k, n *yaml.Node, path string, dst *int, lo, hi int) bool {
	if n.Kind != yaml.ScalarNode {
		l.errAt(n, path, "want an integer, got %s", describeNode(n))
		return false
	}
	switch n.Tag {
	case "!!null":
		return false
	case "!!int":
		var v int64
		if err := n.Decode(&v); err != nil {
			l.errAt(n, path, "integer %s is out of range (%d..%d)", truncate(n.Value), lo, hi)
			return false
		}
		if v < int64(lo) || v > int64(hi) {
			l.errAt(n, path, "%d is out of range (%d..%d)", v, lo, hi)
			return false
		}
		*dst = int(v)
		l.mark(n, path)
		return true
	case "!!float":
		if f, err := strconv.ParseFloat(n.Value, 64); err == nil && f == math.Trunc(f) && !math.IsInf(f, 0) {
			l.errAt(n, path, "integer %s is out of range (%d..%d)", truncate(n.Value), lo, hi)
			return false
		}
	}
	l.errAt(n, path, "want an integer, got %s", describeNode(n))
	return false
}

func (l *loader) str(n *yaml.Node, path string, dst *string) bool {
	if n.Kind != yaml.ScalarNode || (n.Tag != "!!str" && n.Tag != "!!null") {
		l.errAt(n, path, "want a string, got %s", describeNode(n))
		return false
	}
	if n.Tag == "!!null" {
		return false
	}
	*dst = n.Value
	l.mark(n, path)
	return true
}

// list returns the entries of a list of at most max of what (null: none),
// or reports why n is not one and returns ok false.
func (l *loader) list(n *yaml.Node, path, what string, max int) (entries []*yaml.Node, ok bool) {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil, false
	}
	if n.Kind != yaml.SequenceNode {
		l.errAt(n, path, "want a list of %s, got %s", what, describeNode(n))
		return nil, false
	}
	if len(n.Content) > max {
		l.errAt(n, path, "list has %d entries, at most %d allowed", len(n.Content), max)
		return nil, false
	}
	return n.Content, true
}

func (l *loader) strList(n *yaml.Node, path string, dst *[]string) {
	entries, ok := l.list(n, path, "strings", MaxParallel)
	if !ok {
		return
	}
	out := make([]string, 0, len(entries))
	for i, e := range entries {
		e = deref(e)
		var s string
		if l.str(e, fmt.Sprintf("%s[%d]", path, i), &s) {
			out = append(out, s)
		}
	}
	*dst = out
	l.mark(n, path)
}

// worker loads the worker file form.
func (l *loader) worker(root *yaml.Node, env Env) *Worker {
	w := DefaultWorker()
	var ctNode, secNode *yaml.Node
	l.fields(root, "", map[string]func(k, v *yaml.Node){
		"tensor_parallel_size": func(k, v *yaml.Node) {
			l.integer(k, v, "tensor_parallel_size", &w.TensorParallelSize, 1, MaxParallel)
		},
		"security": func(k, v *yaml.Node) { secNode = v },
		"pipeline_parallel_size": func(k, v *yaml.Node) {
			l.integer(k, v, "pipeline_parallel_size", &w.PipelineParallelSize, 1, MaxParallel)
		},
		"kv_cache_config":          func(k, v *yaml.Node) { l.kvCache(v, "kv_cache_config", &w.KVCache) },
		"cache_transceiver_config": func(k, v *yaml.Node) { ctNode = v },
	}, llmAPIIgnored)
	if ctNode != nil {
		// After kv_cache_config, whatever the key order: validation needs
		// tokens_per_block.
		w.CacheTransceiver = l.cacheTransceiver(ctNode, "cache_transceiver_config", w.KVCache.TokensPerBlock, env)
	}
	w.Security = l.security(secNode, "security", env)
	return w
}

func (l *loader) kvCache(n *yaml.Node, path string, kv *KVCache) {
	if !l.mapping(n, path) {
		return
	}
	l.fields(n, path, map[string]func(k, v *yaml.Node){
		"tokens_per_block": func(k, v *yaml.Node) {
			p := join(path, "tokens_per_block")
			if l.integer(k, v, p, &kv.TokensPerBlock, 1, MaxTokensPerBlock) && kv.TokensPerBlock&(kv.TokensPerBlock-1) != 0 {
				l.errAt(v, p, "%d is not a power of two", kv.TokensPerBlock)
			}
		},
		"max_tokens": func(k, v *yaml.Node) {
			l.integer(k, v, join(path, "max_tokens"), &kv.MaxTokens, 1, MaxPoolTokens)
		},
	}, kvCacheIgnored)
}

// cacheTransceiver loads a cache_transceiver_config mapping. Unknown keys are
// errors here (TRT-LLM's model is strict); there are no ignored keys.
func (l *loader) cacheTransceiver(n *yaml.Node, path string, tokensPerBlock int, env Env) *CacheTransceiver {
	ct := defaultCacheTransceiver(BackendUnset)
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		l.c.add(SevWarning, n.Line, n.Column, path, "empty: no transceiver is configured (set backend: DEFAULT to enable one)")
		return nil
	}
	if !l.mapping(n, path) {
		return nil
	}
	l.fields(n, path, map[string]func(k, v *yaml.Node){
		"backend": func(k, v *yaml.Node) {
			p := join(path, "backend")
			var s string
			if !l.str(v, p, &s) {
				return
			}
			b, err := ParseBackend(s)
			if err != nil {
				l.errAt(v, p, "%v", err)
				delete(l.src, p)
				return
			}
			ct.Backend = b
		},
		"max_tokens_in_buffer": func(k, v *yaml.Node) {
			l.integer(k, v, join(path, "max_tokens_in_buffer"), &ct.MaxTokensInBuffer, 1, MaxTokensInBufferLimit)
		},
		"kv_transfer_timeout_ms": func(k, v *yaml.Node) {
			l.integer(k, v, join(path, "kv_transfer_timeout_ms"), &ct.KVTransferTimeoutMs, 1, MaxKVTransferTimeoutMs)
		},
	}, nil)
	applyEnv(ct, env, l.c, l.src, path+".")
	validateCT(ct, tokensPerBlock, l.c, path, l.src)
	return ct
}

// validateCT applies the cross-field rules. src may be nil (hand-built
// configs); positions then are unknown.
func validateCT(ct *CacheTransceiver, tokensPerBlock int, c *collector, path string, src map[string]Source) {
	at := func(field string) (int, int) {
		s := src[join(path, field)]
		return s.Line, s.Col
	}
	if ct.Backend != BackendUnset {
		if _, err := ParseBackend(string(ct.Backend)); err != nil {
			line, col := at("backend")
			c.add(SevError, line, col, join(path, "backend"), "%v", err)
		} else if why := ct.Backend.unsupported(); why != "" {
			line, col := at("backend")
			c.add(SevError, line, col, join(path, "backend"), "%s", why)
		}
	}
	if ct.MaxTokensInBuffer != 0 {
		line, col := at("max_tokens_in_buffer")
		switch {
		case ct.MaxTokensInBuffer < 0 || ct.MaxTokensInBuffer > MaxTokensInBufferLimit:
			c.add(SevError, line, col, join(path, "max_tokens_in_buffer"), "%d is out of range (1..%d)", ct.MaxTokensInBuffer, MaxTokensInBufferLimit)
		case tokensPerBlock > 0 && ct.MaxTokensInBuffer%tokensPerBlock != 0:
			c.add(SevError, line, col, join(path, "max_tokens_in_buffer"), "%d is not a multiple of tokens_per_block (%d)", ct.MaxTokensInBuffer, tokensPerBlock)
		}
	}
	if ct.KVTransferTimeoutMs < 0 || ct.KVTransferTimeoutMs > MaxKVTransferTimeoutMs {
		line, col := at("kv_transfer_timeout_ms")
		c.add(SevError, line, col, join(path, "kv_transfer_timeout_ms"), "%d is out of range (1..%d)", ct.KVTransferTimeoutMs, MaxKVTransferTimeoutMs)
	}
}

// cluster loads the cluster file form.
func (l *loader) cluster(root *yaml.Node, env Env) *Cluster {
	cl := defaultCluster()
	var seenCtx, seenGen bool
	var secNode *yaml.Node
	l.fields(root, "", map[string]func(k, v *yaml.Node){
		"security": func(k, v *yaml.Node) { secNode = v },
		"hostname": func(k, v *yaml.Node) {
			if l.str(v, "hostname", &cl.Hostname) && strings.TrimSpace(cl.Hostname) == "" {
				l.errAt(v, "hostname", "must not be empty")
			}
		},
		"port": func(k, v *yaml.Node) { l.integer(k, v, "port", &cl.Port, 1, 65535) },
		"context_servers": func(k, v *yaml.Node) {
			seenCtx = true
			l.serverGroup(v, "context_servers", &cl.Context, env)
		},
		"generation_servers": func(k, v *yaml.Node) {
			seenGen = true
			l.serverGroup(v, "generation_servers", &cl.Generation, env)
		},
	}, clusterIgnored)
	cl.Security = l.security(secNode, "security", env)
	for _, g := range []struct {
		seen bool
		name string
	}{{seenCtx, "context_servers"}, {seenGen, "generation_servers"}} {
		if !g.seen {
			l.c.add(SevError, 0, 0, g.name, "missing: a cluster file needs both context_servers and generation_servers")
		}
	}
	return cl
}

func (l *loader) serverGroup(n *yaml.Node, path string, g *ServerGroup, env Env) {
	*g = defaultServerGroup()
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		l.errAt(n, path, "empty: want a mapping with at least cache_transceiver_config")
		return
	}
	if !l.mapping(n, path) {
		return
	}
	var ctNode, urlsNode *yaml.Node
	l.fields(n, path, map[string]func(k, v *yaml.Node){
		"num_instances": func(k, v *yaml.Node) {
			l.integer(k, v, join(path, "num_instances"), &g.NumInstances, 1, MaxParallel)
		},
		"tensor_parallel_size": func(k, v *yaml.Node) {
			l.integer(k, v, join(path, "tensor_parallel_size"), &g.TensorParallelSize, 1, MaxParallel)
		},
		"pipeline_parallel_size": func(k, v *yaml.Node) {
			l.integer(k, v, join(path, "pipeline_parallel_size"), &g.PipelineParallelSize, 1, MaxParallel)
		},
		"urls": func(k, v *yaml.Node) {
			urlsNode = v
			l.strList(v, join(path, "urls"), &g.URLs)
		},
		"router":                   func(k, v *yaml.Node) { l.router(v, join(path, "router"), g) },
		"kv_cache_config":          func(k, v *yaml.Node) { l.kvCache(v, join(path, "kv_cache_config"), &g.KVCache) },
		"cache_transceiver_config": func(k, v *yaml.Node) { ctNode = v },
	}, llmAPIIgnored)
	if ctNode != nil {
		g.CacheTransceiver = l.cacheTransceiver(ctNode, join(path, "cache_transceiver_config"), g.KVCache.TokensPerBlock, env)
	}
	if g.CacheTransceiver == nil || g.CacheTransceiver.Backend == BackendUnset {
		line, col := n.Line, n.Column
		if ctNode != nil {
			line, col = ctNode.Line, ctNode.Column
		}
		l.c.add(SevError, line, col, join(path, "cache_transceiver_config.backend"),
			"missing: every server group of a disaggregated cluster needs a transceiver (e.g. cache_transceiver_config: {backend: DEFAULT})")
	}
	if urlsNode != nil && len(g.URLs) > 0 && len(g.URLs) != g.NumInstances {
		l.errAt(urlsNode, join(path, "urls"), "has %d entries but num_instances is %d; give one host:port per instance", len(g.URLs), g.NumInstances)
	}
	for i, u := range g.URLs {
		if err := checkHostPort(u); err != nil {
			l.errAt(deref(urlsNode.Content[i]), fmt.Sprintf("%s.urls[%d]", path, i), "%v", err)
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

func (l *loader) router(n *yaml.Node, path string, g *ServerGroup) {
	if !l.mapping(n, path) {
		return
	}
	l.fields(n, path, map[string]func(k, v *yaml.Node){
		"type": func(k, v *yaml.Node) {
			p := join(path, "type")
			var s string
			if !l.str(v, p, &s) {
				return
			}
			switch s {
			case RouterRoundRobin, RouterLoadBalancing:
				g.Router = s
			case RouterKVCacheAware:
				l.errAt(v, p, "kv_cache_aware is a TensorRT-LLM policy that kvxfer does not implement; use round_robin or load_balancing")
			default:
				l.errAt(v, p, "unknown router type %q (valid: round_robin, load_balancing)", s)
			}
		},
	}, routerIgnored)
}
