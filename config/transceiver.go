package config

import (
	"fmt"
	"strings"

	"go.yaml.in/yaml/v3"
)

// transceiverOf loads the cache transceiver of a worker file or a server
// group from its entries: cache_transceiver_config, and the older
// enable_cache_transceiver. It returns nil when there is none.
func (l *loader) transceiverOf(es entries, prefix string, tokensPerBlock int, env Env) *CacheTransceiver {
	srcPath := join(prefix, "cache_transceiver_config")
	en := l.enableFlag(es, prefix)
	ctEntry, hasCT := es["cache_transceiver_config"]
	var ct *CacheTransceiver
	switch {
	case hasCT:
		l.with(ctEntry, prefix, "cache_transceiver_config", func(path string) {
			ct = l.cacheTransceiver(ctEntry.val, path, en)
			if ct != nil {
				l.finishCT(ct, path, srcPath, tokensPerBlock, env)
			}
		})
	case en.on():
		// enable_cache_transceiver: true without a block: the transceiver
		// with the backend the environment picks, as in the older
		// releases.
		ct = defaultCacheTransceiver(BackendDefault)
		note := "implied by enable_cache_transceiver"
		if es["enable_cache_transceiver"].top && prefix != "" {
			note += "; top level"
		}
		l.markNote(en.node, join(srcPath, "backend"), note)
		l.finishCT(ct, srcPath, srcPath, tokensPerBlock, env)
	}
	return ct
}

// enableFlag is the older enable_cache_transceiver: its value (nil when
// absent or invalid), node and problem path.
type enableFlag struct {
	v    *bool
	node *yaml.Node
	path string
}

func (e enableFlag) on() bool  { return e.v != nil && *e.v }
func (e enableFlag) off() bool { return e.v != nil && !*e.v }

// enableFlag loads the older enable_cache_transceiver, when present, and
// warns that it is an older form.
func (l *loader) enableFlag(es entries, prefix string) enableFlag {
	e, ok := es["enable_cache_transceiver"]
	if !ok {
		return enableFlag{}
	}
	var v bool
	out := enableFlag{node: e.val}
	l.with(e, prefix, "enable_cache_transceiver", func(path string) {
		out.path = path
		if !l.boolean(e.val, path, &v) {
			return
		}
		out.v = &v
		if v {
			l.c.warn(KindDeprecated, e.key.Line, e.key.Column, path,
				"older TensorRT-LLM form: read as a transceiver with backend DEFAULT; the current form is cache_transceiver_config: {backend: DEFAULT}")
		} else {
			l.c.warn(KindDeprecated, e.key.Line, e.key.Column, path,
				"older TensorRT-LLM form: no transceiver; the current form leaves cache_transceiver_config out")
		}
	})
	return out
}

// cacheTransceiver loads a cache_transceiver_config mapping, reporting
// problems at path (its sources go where loader.inherit says). Unknown keys
// are errors here (TRT-LLM's model is strict). en is the older
// enable_cache_transceiver.
func (l *loader) cacheTransceiver(n *yaml.Node, path string, en enableFlag) *CacheTransceiver {
	ct := defaultCacheTransceiver(BackendUnset)
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		l.c.warn("", n.Line, n.Column, path, "empty: no transceiver is configured (set backend: DEFAULT to enable one)")
		return nil
	}
	if !l.mapping(n, path) {
		return nil
	}
	var backendGiven bool
	var oldTokens, newTokens *yaml.Node
	l.fields(n, path, map[string]func(k, v *yaml.Node){
		"backend": func(k, v *yaml.Node) { backendGiven = true; l.backend(v, join(path, "backend"), ct) },
		keyRuntime: func(k, v *yaml.Node) {
			p := join(path, keyRuntime)
			if !l.str(v, p, &ct.Runtime) {
				return
			}
			if ct.Runtime != "CPP" && ct.Runtime != "PYTHON" {
				l.errAt(v, p, "want CPP or PYTHON, got %q", truncate(ct.Runtime))
				ct.Runtime = ""
				return
			}
			l.c.warn(KindNotApplied, k.Line, k.Column, p, "%s accepted, not applicable: kvxfer is its own transfer runtime, "+
				"neither of TensorRT-LLM's C++ and Python transceivers", ct.Runtime)
		},
		"max_tokens_in_buffer": func(k, v *yaml.Node) {
			newTokens = k
			l.integer(v, join(path, "max_tokens_in_buffer"), &ct.MaxTokensInBuffer, 1, MaxTokensInBufferLimit)
		},
		// max_num_tokens is the older name of max_tokens_in_buffer.
		"max_num_tokens": func(k, v *yaml.Node) {
			oldTokens = k
			if newTokens != nil {
				return
			}
			l.integer(v, join(path, "max_tokens_in_buffer"), &ct.MaxTokensInBuffer, 1, MaxTokensInBufferLimit)
		},
		"kv_transfer_timeout_ms": l.intKey(path, "kv_transfer_timeout_ms", &ct.KVTransferTimeoutMs, 1, MaxKVTransferTimeoutMs),
		keySenderTimeout:         l.intKey(path, keySenderTimeout, &ct.SenderFutureTimeoutMs, 1, MaxKVTransferTimeoutMs),
	}, nil, true)
	l.oldForms(ct, path, n, oldTokens, newTokens, backendGiven, en)
	if ct.Backend == BackendUnset && !backendGiven && (ct.MaxTokensInBuffer > 0 || ct.SenderFutureTimeoutMs > 0) {
		l.c.warn("", n.Line, n.Column, join(path, "backend"), "not set: no transceiver is configured, and the other fields of the block have no effect (set backend: DEFAULT to enable one)")
	}
	return ct
}

// backend parses cache_transceiver_config.backend into ct.
func (l *loader) backend(v *yaml.Node, path string, ct *CacheTransceiver) {
	if v.Kind != yaml.ScalarNode || v.Tag != "!!str" {
		l.errAt(v, path, "want a backend name, got %s", describeNode(v))
		return
	}
	s := strings.TrimSpace(v.Value)
	if strings.EqualFold(s, "V2") {
		ct.Backend = BackendDefault
		l.mark(v, path)
		l.c.warn(KindDeprecated, v.Line, v.Column, path, "backend %s is an older TensorRT-LLM form (its experimental transceiver), read as DEFAULT; the current form is backend: DEFAULT", s)
		return
	}
	b, err := ParseBackend(s)
	if err != nil {
		l.errAt(v, path, "%v", err)
		return
	}
	ct.Backend = b
	l.mark(v, path)
	switch {
	case s == string(b):
	case b == BackendDefault || b == BackendUCX || b == BackendNIXL || b == BackendMPI:
		l.c.warn(KindDeprecated, v.Line, v.Column, path, "lower-case backend names are the mid-2025 TensorRT-LLM form, which current TensorRT-LLM refuses; the current form is backend: %s", b)
	default:
		l.c.warn(KindDeprecated, v.Line, v.Column, path, "backend names are written in upper case, kvxfer's as TensorRT-LLM's: backend: %s", b)
	}
}

// oldForms applies the older forms of the block: max_num_tokens (the old
// name of max_tokens_in_buffer), a block without a backend that has only
// max_num_tokens (the transceiver was then on, its backend chosen by the
// environment), and enable_cache_transceiver.
func (l *loader) oldForms(ct *CacheTransceiver, path string, n, oldTokens, newTokens *yaml.Node, backendGiven bool, en enableFlag) {
	if oldTokens != nil {
		p := join(path, "max_num_tokens")
		if newTokens != nil {
			l.errAt(oldTokens, p, "set max_tokens_in_buffer or its older name max_num_tokens, not both")
		} else if ct.MaxTokensInBuffer > 0 {
			l.c.warn(KindDeprecated, oldTokens.Line, oldTokens.Column, p,
				"older TensorRT-LLM name of max_tokens_in_buffer; the current form is max_tokens_in_buffer: %d", ct.MaxTokensInBuffer)
		}
	}
	switch {
	case backendGiven:
		if en.off() {
			l.errAt(en.node, en.path, "false, but cache_transceiver_config sets a backend; remove the older enable_cache_transceiver")
		}
	case en.on():
		ct.Backend = BackendDefault
		l.markNote(en.node, join(path, "backend"), "implied by enable_cache_transceiver")
	case oldTokens != nil && newTokens == nil:
		ct.Backend = BackendDefault
		l.markNote(n, join(path, "backend"), "implied by the older form")
		l.c.warn(KindDeprecated, n.Line, n.Column, join(path, "backend"),
			"not set in an older TensorRT-LLM form, where the transceiver was on and TRTLLM_USE_*_KVCACHE chose its backend: read as backend: DEFAULT; the current form sets it")
	}
}

// finishCT applies the environment to ct and validates it.
func (l *loader) finishCT(ct *CacheTransceiver, path, srcPath string, tokensPerBlock int, env Env) {
	applyEnv(ct, env, l.c, l.src, srcPath+".")
	validateCT(ct, tokensPerBlock, l.c, path, srcPath, l.src)
}

// validateCT applies the cross-field rules, reporting at path and finding
// positions under srcPath in src. src may be nil (hand-built configs);
// positions then are unknown.
func validateCT(ct *CacheTransceiver, tokensPerBlock int, c *collector, path, srcPath string, src map[string]Source) {
	at := func(field string) (int, int) {
		s := src[join(srcPath, field)]
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
	if s := ct.SenderFutureTimeoutMs; s != 0 {
		line, col := at(keySenderTimeout)
		switch {
		case s < 0 || s > MaxKVTransferTimeoutMs:
			c.add(SevError, line, col, join(path, keySenderTimeout), "%d is out of range (1..%d)", s, MaxKVTransferTimeoutMs)
		case int64(s) >= ct.Timeout().Milliseconds():
			c.warn("", line, col, join(path, keySenderTimeout), "%d has no effect: kv_transfer_timeout_ms (%d) ends the request first", s, ct.Timeout().Milliseconds())
		}
	}
}

// NewCacheTransceiver returns the config of a worker started from flags
// rather than a file: backend b (parsed, any case), every other file field
// at its default, the environment applied, validated against
// tokensPerBlock.
func NewCacheTransceiver(b string, tokensPerBlock int, env Env) (*CacheTransceiver, error) {
	backend, err := ParseBackend(b)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	ct := defaultCacheTransceiver(backend)
	c := &collector{}
	applyEnv(ct, env, c, map[string]Source{}, "")
	validateCT(ct, tokensPerBlock, c, "cache_transceiver_config", "cache_transceiver_config", nil)
	if errs := c.errs(); len(errs) > 0 {
		return nil, errs
	}
	return ct, nil
}
