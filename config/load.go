package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// MaxFileSize bounds the size of a config file; anything larger is refused
// before it is parsed.
const MaxFileSize = 1 << 20

// PipeTimeout bounds how long LoadFile waits for the writer of a named
// pipe (`kvxfer config check <(render-config)`): for the first data, or
// for the writer to close it empty, and then for each read. A pipe that
// nobody writes to is an error naming it, not a wait without end.
const PipeTimeout = 10 * time.Second

// LoadFile reads and loads the config file at path with the environment
// snapshot env: a regular file, or a named pipe (process substitution),
// which it reads within PipeTimeout. Either is read up to MaxFileSize. See
// LoadBytes.
func LoadFile(path string, env Env) (*File, error) {
	return loadFileWithin(path, env, PipeTimeout)
}

// loadFileWithin is LoadFile with pipeWait in place of PipeTimeout.
func loadFileWithin(path string, env Env, pipeWait time.Duration) (*File, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fileError(path, describeOSError(err))
	}
	if fi.IsDir() {
		return nil, fileError(path, "is a directory, not a config file")
	}
	var data []byte
	switch {
	case fi.Mode().IsRegular():
		fh, err := os.Open(path)
		if err != nil {
			return nil, fileError(path, describeOSError(err))
		}
		defer fh.Close()
		data, err = io.ReadAll(io.LimitReader(fh, MaxFileSize+1))
		if err != nil {
			return nil, fileError(path, describeOSError(err))
		}
	case fi.Mode()&os.ModeNamedPipe != 0:
		data, err = readPipe(path, MaxFileSize+1, pipeWait)
		if err != nil {
			return nil, fileError(path, describeOSError(err))
		}
	default:
		return nil, fileError(path, "is not a regular file")
	}
	return LoadBytes(path, data, env)
}

// readUpTo reads the file at path, at most limit bytes: a named pipe
// within pipeWait (readPipe), anything else as it is.
func readUpTo(path string, limit int64, pipeWait time.Duration) ([]byte, error) {
	if fi, err := os.Stat(path); err == nil && fi.Mode()&os.ModeNamedPipe != 0 {
		return readPipe(path, limit, pipeWait)
	}
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	return io.ReadAll(io.LimitReader(fh, limit))
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
	if isCluster(root) {
		f.Kind = KindCluster
		f.Cluster = l.cluster(root, env)
	} else {
		f.Kind = KindWorker
		f.Worker = l.worker(root, env)
	}
	if len(f.Transceivers()) > 0 {
		envNotes(env, c)
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

// isCluster tells a cluster file by its keys: context_servers or
// generation_servers, or disagg_cluster among cluster keys only (the router's
// file of a cluster whose workers register themselves; a worker file may
// hold disagg_cluster too, beside its LLM API options).
func isCluster(m *yaml.Node) bool {
	dynamic, onlyCluster := false, true
	for i := 0; i+1 < len(m.Content); i += 2 {
		k := m.Content[i].Value
		switch {
		case slices.Contains(clusterMarkers, k):
			return true
		case k == keyDisaggCluster:
			dynamic = true
		case !slices.Contains(clusterKeys, k):
			onlyCluster = false
		}
	}
	return dynamic && onlyCluster
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
	// inherit is set while a server group loads a value it takes from the
	// cluster file's top level: sources are then recorded under the
	// group's path (from → to), noted "top level"; problems keep the
	// top-level path, so that a problem of the value is reported once.
	inherit *pathAlias
}

type pathAlias struct{ from, to string }

func (l *loader) errAt(n *yaml.Node, path, format string, args ...any) {
	l.c.add(SevError, n.Line, n.Column, path, format, args...)
}

// mark records that the value at path came from node n of the file.
func (l *loader) mark(n *yaml.Node, path string) { l.markNote(n, path, "") }

// markNote is mark with a note: the older form the value is implied by.
func (l *loader) markNote(n *yaml.Node, path, note string) {
	s := Source{Kind: SourceFile, File: l.c.file, Line: n.Line, Col: n.Column, Note: note}
	if a := l.inherit; a != nil && (path == a.from || strings.HasPrefix(path, a.from+".") || strings.HasPrefix(path, a.from+"[")) {
		path = a.to + path[len(a.from):]
		s.Note = strings.TrimPrefix(s.Note+"; top level", "; ")
	}
	l.src[path] = s
}

func join(prefix, key string) string {
	if prefix == "" {
		return key
	}
	return prefix + "." + key
}

// fields walks mapping m. A key in read is handed to its function. Any
// other key is an error when strict (a block kvxfer owns, or one that
// TensorRT-LLM keeps strict), or when it is a near miss of a key in read (a
// typo, reported with the suggestion); else it is a warning: a key kvxfer
// does not use, known (listed in known) or not. Duplicate keys are errors.
// m must already be a mapping.
func (l *loader) fields(m *yaml.Node, prefix string, read map[string]func(key, val *yaml.Node), known []string, strict bool) {
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
		if fn, ok := read[k.Value]; ok {
			fn(k, v)
			continue
		}
		l.unread(k, path, read, known, strict)
	}
}

// hiddenKeys are keys kvxfer reads only to explain them (older forms, a
// documented misspelling); they are not offered as valid.
var hiddenKeys = []string{"max_num_tokens", "enable_cache_transceiver", "inactive_interval_sec"}

// unread reports key k, which kvxfer does not read here.
func (l *loader) unread(k *yaml.Node, path string, read map[string]func(key, val *yaml.Node), known []string, strict bool) {
	readKeys := sortedKeys(read)
	if !strict && slices.Contains(known, k.Value) {
		l.c.warn(KindNotUsed, k.Line, k.Column, path, "known TensorRT-LLM key, not used by kvxfer")
		return
	}
	if s := suggest(k.Value, readKeys); s != "" {
		l.errAt(k, path, "unknown key; did you mean %q?", s)
		return
	}
	if strict {
		valid := slices.DeleteFunc(readKeys, func(k string) bool { return slices.Contains(hiddenKeys, k) })
		l.errAt(k, path, "unknown key (valid here: %s)", strings.Join(valid, ", "))
		return
	}
	msg := "not a key kvxfer knows (a newer TensorRT-LLM option?); not used by kvxfer"
	if s := suggest(k.Value, known); s != "" {
		msg += fmt.Sprintf(" (a typo of %q, which kvxfer does not use either?)", s)
	}
	l.c.warn(KindNotUsed, k.Line, k.Column, path, "%s", msg)
}

// block walks n as a mapping (see fields) and reports whether it is one;
// null and anything else are not, and the latter is reported.
func (l *loader) block(n *yaml.Node, path string, read map[string]func(key, val *yaml.Node), known []string, strict bool) bool {
	if !l.mapping(n, path) {
		return false
	}
	l.fields(n, path, read, known, strict)
	return true
}

// intKey is the function fields calls for an integer key of the block at
// path, stored into *dst when in [lo, hi].
func (l *loader) intKey(path, key string, dst *int, lo, hi int) func(k, v *yaml.Node) {
	return func(_, v *yaml.Node) { l.integer(v, join(path, key), dst, lo, hi) }
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
func (l *loader) integer(n *yaml.Node, path string, dst *int, lo, hi int) bool {
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

// boolean decodes n into *dst when it is true or false (YAML 1.2: True and
// TRUE too). A null value leaves *dst unchanged. It reports whether *dst
// was set.
func (l *loader) boolean(n *yaml.Node, path string, dst *bool) bool {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return false
	}
	if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
		l.errAt(n, path, "want true or false, got %s", describeNode(n))
		return false
	}
	if err := n.Decode(dst); err != nil {
		l.errAt(n, path, "want true or false, got %s", describeNode(n))
		return false
	}
	l.mark(n, path)
	return true
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
		ep := fmt.Sprintf("%s[%d]", path, i)
		if e.Kind == yaml.ScalarNode && e.Tag == "!!null" {
			// Unlike a key's null (unset), an entry's is a missing value.
			l.errAt(e, ep, "want a string, got null")
			continue
		}
		var s string
		if l.str(e, ep, &s) {
			out = append(out, s)
		}
	}
	*dst = out
	l.mark(n, path)
}

// llmKeys are the LLM API options kvxfer reads, in a worker file and in a
// server group (where the cluster file's top level may give them too).
var llmKeys = []string{"tensor_parallel_size", "pipeline_parallel_size", "kv_cache_config", "cache_transceiver_config", "enable_cache_transceiver"}

// entry is one option kvxfer reads, as found in a worker file or a server
// group, or taken by a group from the cluster file's top level (top).
type entry struct {
	key, val *yaml.Node
	top      bool
}

// entries holds the options kvxfer reads of one block, by key.
type entries map[string]entry

// collect adds to read a function for each key that stores its entry.
func (es entries) collect(read map[string]func(k, v *yaml.Node), keys []string, top bool) {
	for _, key := range keys {
		read[key] = func(k, v *yaml.Node) { es[key] = entry{k, v, top} }
	}
}

// with runs fn with the path problems of e are reported at: key under
// prefix, or the top-level key for a value taken from the top level, whose
// sources are then recorded under prefix (loader.inherit).
func (l *loader) with(e entry, prefix, key string, fn func(path string)) {
	if !e.top || prefix == "" {
		fn(join(prefix, key))
		return
	}
	l.inherit = &pathAlias{from: key, to: join(prefix, key)}
	defer func() { l.inherit = nil }()
	fn(key)
}

// parallel is the layout part of a worker or a server group.
type parallel struct {
	tp, pp *int
	kv     *KVCache
}

// options loads the LLM API options kvxfer reads from es (see llmKeys)
// into p and returns the cache transceiver, nil when there is none.
func (l *loader) options(es entries, prefix string, p parallel, env Env) *CacheTransceiver {
	for _, f := range []struct {
		key string
		dst *int
	}{{"tensor_parallel_size", p.tp}, {"pipeline_parallel_size", p.pp}} {
		if e, ok := es[f.key]; ok {
			l.with(e, prefix, f.key, func(path string) { l.integer(e.val, path, f.dst, 1, MaxParallel) })
		}
	}
	if e, ok := es["kv_cache_config"]; ok {
		l.with(e, prefix, "kv_cache_config", func(path string) { l.kvCache(e.val, path, p.kv) })
	}
	// After kv_cache_config, whatever the key order: validation needs
	// tokens_per_block.
	return l.transceiverOf(es, prefix, p.kv.TokensPerBlock, env)
}

// worker loads the worker file form.
func (l *loader) worker(root *yaml.Node, env Env) *Worker {
	w := DefaultWorker()
	es := entries{}
	var secNode *yaml.Node
	read := map[string]func(k, v *yaml.Node){
		"security":       func(k, v *yaml.Node) { secNode = v },
		keyDisaggCluster: func(k, v *yaml.Node) { w.DisaggCluster = l.disaggCluster(k, v, keyDisaggCluster) },
	}
	es.collect(read, llmKeys, false)
	l.fields(root, "", read, llmAPIKnown, false)
	w.CacheTransceiver = l.options(es, "", parallel{&w.TensorParallelSize, &w.PipelineParallelSize, &w.KVCache}, env)
	w.Security = l.security(secNode, "security", env)
	return w
}

func (l *loader) kvCache(n *yaml.Node, path string, kv *KVCache) {
	l.block(n, path, map[string]func(k, v *yaml.Node){
		"tokens_per_block": func(k, v *yaml.Node) {
			p := join(path, "tokens_per_block")
			if l.integer(v, p, &kv.TokensPerBlock, 1, MaxTokensPerBlock) && kv.TokensPerBlock&(kv.TokensPerBlock-1) != 0 {
				l.errAt(v, p, "%d is not a power of two", kv.TokensPerBlock)
			}
		},
		"max_tokens":            l.intKey(path, "max_tokens", &kv.MaxTokens, 1, MaxPoolTokens),
		"enable_block_reuse":    l.optBoolKey(path, "enable_block_reuse", &kv.EnableBlockReuse),
		"enable_partial_reuse":  l.optBoolKey(path, "enable_partial_reuse", &kv.EnablePartialReuse),
		"copy_on_partial_reuse": l.optBoolKey(path, "copy_on_partial_reuse", &kv.CopyOnPartialReuse),
		"event_buffer_max_size": l.intKey(path, "event_buffer_max_size", &kv.EventBufferMaxSize, 0, MaxEventBufferSize),
	}, kvCacheKnown, false)
}

// optBoolKey is the function fields calls for a boolean key of the block
// at path that stays nil (unset: the default) unless given.
func (l *loader) optBoolKey(path, key string, dst **bool) func(k, v *yaml.Node) {
	return func(_, v *yaml.Node) {
		var b bool
		if l.boolean(v, join(path, key), &b) {
			*dst = &b
		}
	}
}
