package config

import (
	"errors"
	"strings"
	"testing"
)

// loadCluster loads a cluster file's text with an empty environment.
func loadText(t *testing.T, text string) (*File, error) {
	t.Helper()
	return LoadBytes("c.yaml", []byte(text), Env{}.WithInterfaces("lo"))
}

// warned reports whether f has a warning at path whose message contains
// msg.
func warned(f *File, path, msg string) bool {
	for _, w := range f.Warnings {
		if w.Path == path && strings.Contains(w.Msg, msg) {
			return true
		}
	}
	return false
}

// TestTopLevelMerge is the merge rule of cluster files as a table: a key
// kvxfer reads, set at the top level only, in a group only, or in both
// (the group's value wins, and a different value is warned about, since
// TensorRT-LLM refuses such a file).
func TestTopLevelMerge(t *testing.T) {
	groups := func(ctx, gen string) string {
		return "context_servers:\n  num_instances: 1\n" + ctx + "generation_servers:\n  num_instances: 1\n" + gen
	}
	tests := []struct {
		name, text string
		check      func(cl *Cluster) bool
		// where each group's value came from: "top level", "" (the
		// group itself) or "default".
		ctxFrom, genFrom string
		field            string // path under a group of the value checked
		conflict         string // the group warned about, "" for none
	}{
		{"tp top only", "tensor_parallel_size: 4\n" + groups("", ""),
			func(cl *Cluster) bool {
				return cl.Context.TensorParallelSize == 4 && cl.Generation.TensorParallelSize == 4
			},
			"top level", "top level", "tensor_parallel_size", ""},
		{"tp group only", groups("  tensor_parallel_size: 2\n", ""),
			func(cl *Cluster) bool {
				return cl.Context.TensorParallelSize == 2 && cl.Generation.TensorParallelSize == 1
			},
			"", "default", "tensor_parallel_size", ""},
		{"tp both, group wins", "tensor_parallel_size: 4\n" + groups("", "  tensor_parallel_size: 2\n"),
			func(cl *Cluster) bool {
				return cl.Context.TensorParallelSize == 4 && cl.Generation.TensorParallelSize == 2
			},
			"top level", "", "tensor_parallel_size", "generation_servers"},
		{"tp both, same value", "tensor_parallel_size: 2\n" + groups("  tensor_parallel_size: 2\n", ""),
			func(cl *Cluster) bool {
				return cl.Context.TensorParallelSize == 2 && cl.Generation.TensorParallelSize == 2
			},
			"", "top level", "tensor_parallel_size", ""},
		{"transceiver top only", "cache_transceiver_config:\n  backend: UCX\n  max_tokens_in_buffer: 4096\n" + groups("", ""),
			func(cl *Cluster) bool {
				return cl.Context.CacheTransceiver.Backend == BackendUCX && cl.Generation.CacheTransceiver.MaxTokensInBuffer == 4096 &&
					cl.Context.CacheTransceiver != cl.Generation.CacheTransceiver
			},
			"top level", "top level", "cache_transceiver_config.backend", ""},
		{"transceiver group only", groups("  cache_transceiver_config: {backend: TCP}\n", ""),
			func(cl *Cluster) bool {
				return cl.Context.CacheTransceiver.Backend == BackendTCP && cl.Generation.CacheTransceiver == nil
			},
			"", "default", "cache_transceiver_config.backend", ""},
		{"transceiver both, group wins as a whole", "cache_transceiver_config:\n  backend: UCX\n  kv_transfer_timeout_ms: 5000\n" +
			groups("", "  cache_transceiver_config: {backend: SHM}\n"),
			func(cl *Cluster) bool {
				g := cl.Generation.CacheTransceiver
				return cl.Context.CacheTransceiver.Backend == BackendUCX && g.Backend == BackendSHM && g.KVTransferTimeoutMs == DefaultKVTransferTimeoutMs
			},
			"top level", "", "cache_transceiver_config.backend", "generation_servers"},
		{"kv_cache_config both: per key, not deep", "kv_cache_config:\n  tokens_per_block: 64\n  max_tokens: 4096\n" +
			groups("  kv_cache_config:\n    max_tokens: 8192\n", ""),
			func(cl *Cluster) bool {
				return cl.Context.KVCache == KVCache{TokensPerBlock: DefaultTokensPerBlock, MaxTokens: 8192} &&
					cl.Generation.KVCache == KVCache{TokensPerBlock: 64, MaxTokens: 4096}
			},
			"", "top level", "kv_cache_config.max_tokens", "context_servers"},
		{"router top only", "router: {type: load_balancing}\n" + groups("", ""),
			func(cl *Cluster) bool {
				return cl.Context.Router == RouterLoadBalancing && cl.Generation.Router == RouterLoadBalancing
			},
			"top level", "top level", "router.type", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := loadText(t, tc.text)
			if err != nil {
				t.Fatalf("load: %v\n%s", err, tc.text)
			}
			if !tc.check(f.Cluster) {
				t.Errorf("merged groups: %+v", f.Cluster)
			}
			for _, g := range []struct{ name, want string }{{"context_servers", tc.ctxFrom}, {"generation_servers", tc.genFrom}} {
				s := f.Source(g.name + "." + tc.field)
				switch got := s.Note; {
				case g.want == "default" && s.Kind != SourceDefault:
					t.Errorf("%s.%s: source %s, want the default", g.name, tc.field, s)
				case g.want != "default" && (s.Kind != SourceFile || got != g.want):
					t.Errorf("%s.%s: source %s, want the file with note %q", g.name, tc.field, s, g.want)
				}
			}
			conflicts := 0
			for _, w := range f.Warnings {
				if strings.Contains(w.Msg, "also set at the top level") {
					conflicts++
					if !strings.HasPrefix(w.Path, tc.conflict+".") {
						t.Errorf("conflict warned at %s, want %s", w.Path, tc.conflict)
					}
				}
			}
			if want := btoi(tc.conflict != ""); conflicts != want {
				t.Errorf("%d conflict warnings, want %d: %v", conflicts, want, f.Warnings)
			}
		})
	}
}

// TestInheritedProblemReportedOnce: a problem in a block both groups take
// from the top level is reported once, at the top level.
func TestInheritedProblemReportedOnce(t *testing.T) {
	_, err := loadText(t, "cache_transceiver_config:\n  backend: UCX\n  max_tokens_in_buffr: 64\ncontext_servers: {}\ngeneration_servers: {}\n")
	var ps Problems
	if !errors.As(err, &ps) || len(ps) != 1 || ps[0].Path != "cache_transceiver_config.max_tokens_in_buffr" || ps[0].Line != 3 {
		t.Fatalf("want one error at the top level, got %v", err)
	}
}

// loadCase is a text and what loading it gives: a file of kind (0: any),
// and, when msg is set, a problem of severity sev at path whose message
// contains msg; without msg, no error.
type loadCase struct {
	text string
	kind Kind
	sev  Severity
	path string
	msg  string
}

func (tc loadCase) check(t *testing.T) {
	t.Helper()
	f, err := loadText(t, tc.text)
	if f == nil || (tc.kind != 0 && f.Kind != tc.kind) {
		t.Errorf("%q: file %+v, want kind %v (%v)", tc.text, f, tc.kind, err)
		return
	}
	found := tc.msg == "" && err == nil
	var ps Problems
	switch {
	case tc.msg == "":
	case tc.sev == SevError && errors.As(err, &ps):
		for _, p := range ps {
			found = found || (p.Path == tc.path && strings.Contains(p.Msg, tc.msg))
		}
	case tc.sev == SevWarning && err == nil:
		found = warned(f, tc.path, tc.msg)
	}
	if !found {
		t.Errorf("%q: want %s at %s containing %q; got err %v, warnings %v", tc.text, tc.sev, tc.path, tc.msg, err, f.Warnings)
	}
}

// TestKeyRules: a key kvxfer does not read is a warning, unless it is a
// near miss of one it reads or sits in a strict block.
func TestKeyRules(t *testing.T) {
	for _, tc := range []loadCase{
		{"moe_tensor_parallel_size: 2\n", 0, SevWarning, "moe_tensor_parallel_size", "known TensorRT-LLM key, not used"},
		{"peft_cache_config: {}\n", 0, SevWarning, "peft_cache_config", "known TensorRT-LLM key, not used"},
		{"brand_new_option: 1\n", 0, SevWarning, "brand_new_option", "not a key kvxfer knows"},
		{"disable_overlap_schedular: true\n", 0, SevWarning, "disable_overlap_schedular", `a typo of "disable_overlap_scheduler"`},
		{"tensor_paralel_size: 2\n", 0, SevError, "tensor_paralel_size", `did you mean "tensor_parallel_size"?`},
		{"kv_cache_config:\n  tokens_per_blok: 16\n", 0, SevError, "kv_cache_config.tokens_per_blok", `did you mean "tokens_per_block"?`},
		{"kv_cache_config:\n  use_kv_cache_manager_v2: true\n", 0, SevWarning, "kv_cache_config.use_kv_cache_manager_v2", "known"},
		{"cache_transceiver_config:\n  backend: UCX\n  compression: zstd\n", 0, SevError, "cache_transceiver_config.compression",
			"unknown key (valid here: backend, kv_transfer_sender_future_timeout_ms, kv_transfer_timeout_ms, max_tokens_in_buffer, transceiver_runtime)"},
		{"security:\n  secret: x\n", 0, SevError, "security.secret", "unknown key"},
	} {
		tc.check(t)
	}
}

// TestClusterShapes: the shapes a cluster file may take beyond two full
// groups.
func TestClusterShapes(t *testing.T) {
	for _, tc := range []loadCase{
		{"context_servers: {urls: ['a:1']}\ngeneration_servers: {urls: ['b:2']}\n", KindCluster, 0, "", ""}, // no transceivers
		{"context_servers:\ngeneration_servers: {num_instances: 2}\n", KindCluster, 0, "", ""},              // a null group
		{"context_servers: {num_instances: 0}\ngeneration_servers: {}\n", KindCluster, SevWarning, "context_servers.num_instances", "generation-only benchmark mode"},
		{"port: 9000\ndisagg_cluster: {cluster_uri: 'etcd://h:2379'}\n", KindCluster, 0, "", ""},
		{"disagg_cluster: {cluster_uri: 'http://h:8000'}\ncache_transceiver_config: {backend: TCP}\n", KindWorker, 0, "", ""},
		{"hostname: h\ndisagg_cluster: {cluster_name: x}\n", KindCluster, SevError, "disagg_cluster.cluster_uri", "missing"},
		{"context_servers: {}\n", KindCluster, SevError, "generation_servers", "missing"},
		{"context_servers: {num_instances: 0, urls: ['a:1']}\ngeneration_servers: {}\n", KindCluster, SevError, "context_servers.urls", "has 1 entries but num_instances is 0"},
		// A null entry is a missing url, not one fewer instance.
		{"context_servers: {urls: [null, 'a:1']}\ngeneration_servers: {urls: ['b:2']}\n", KindCluster, SevError, "context_servers.urls[0]", "want a string, got null"},
		// A bad url is named by its own index, whatever entry before it was refused.
		{"context_servers: {urls: [5, 'bad']}\ngeneration_servers: {urls: ['b:2']}\n", KindCluster, SevError, "context_servers.urls[1]", `"bad" is not host:port`},
	} {
		tc.check(t)
	}
}

// TestKnownKeysLoad: every key kvxfer knows it does not use loads with a
// warning, never an error, even when it is close to a key kvxfer reads
// (moe_tensor_parallel_size and tensor_parallel_size): a list that made one
// an error would refuse a real upstream file.
func TestKnownKeysLoad(t *testing.T) {
	var texts []string
	for _, k := range llmAPIKnown {
		texts = append(texts, k+": null\n", "context_servers:\n  "+k+": null\ngeneration_servers: {}\n")
	}
	for _, k := range clusterKnown {
		texts = append(texts, k+": null\ncontext_servers: {}\ngeneration_servers: {}\n")
	}
	for _, k := range kvCacheKnown {
		texts = append(texts, "kv_cache_config:\n  "+k+": null\n")
	}
	for _, k := range routerKnown {
		texts = append(texts, "context_servers:\n  router: {"+k+": null}\ngeneration_servers: {}\n")
	}
	for _, text := range texts {
		f, err := loadText(t, text)
		if err != nil || len(f.Warnings) != 1 || f.Warnings[0].Kind != KindNotUsed {
			t.Errorf("%q: error %v, warnings %v; want one not-used warning", text, err, f.Warnings)
		}
	}
}

// TestBackendForms: older and refused names, each with one message.
func TestBackendForms(t *testing.T) {
	for _, tc := range []struct {
		backend string
		want    Backend
		msg     string // of the one warning or error
		err     bool
	}{
		{"UCX", BackendUCX, "", false},
		{"ucx", BackendUCX, "mid-2025 TensorRT-LLM form", false},
		{"tcp", BackendTCP, "written in upper case", false},
		{"V2", BackendDefault, "older TensorRT-LLM form", false},
		{"MOONCAKE", BackendMooncake, "MOONCAKE (TensorRT-LLM's Mooncake Transfer Engine backend) is not available in kvxfer", true},
		{"NIXL", BackendNIXL, "NIXL is not available in kvxfer", true},
		{"MPI", BackendMPI, "", false},
		{"RDMA", BackendUnset, `unknown backend "RDMA"`, true},
	} {
		for _, text := range []string{
			"cache_transceiver_config:\n  backend: " + tc.backend + "\n",
			"context_servers:\n  cache_transceiver_config: {backend: " + tc.backend + "}\ngeneration_servers: {}\n",
		} {
			f, err := loadText(t, text)
			var msgs []string
			var ps Problems
			if errors.As(err, &ps) {
				for _, p := range ps {
					msgs = append(msgs, p.Msg)
				}
			}
			if f != nil {
				for _, w := range f.Warnings {
					if strings.HasSuffix(w.Path, ".backend") {
						msgs = append(msgs, w.Msg)
					}
				}
			}
			if tc.err != (err != nil) || (tc.msg == "") != (len(msgs) == 0) || (tc.msg != "" && (len(msgs) != 1 || !strings.Contains(msgs[0], tc.msg))) {
				t.Errorf("backend %s in %q: err %v, messages %q; want one containing %q", tc.backend, text, err, msgs, tc.msg)
			}
			if ts := f.Transceivers(); err == nil && (len(ts) != 1 || ts[0].CT.Backend != tc.want) {
				t.Errorf("backend %s: loaded %+v, want %s", tc.backend, ts, tc.want)
			}
		}
	}
}

// TestDefaultWithNIXLEnv: DEFAULT resolved through TRTLLM_USE_NIXL_KVCACHE=1
// is AUTO with a warning naming the variable, the same answer for config
// check and serve (both call Resolve); an explicit NIXL stays an error.
// Through TRTLLM_USE_MPI_KVCACHE=1 it is MPI, saying why and what it means.
func TestDefaultWithNIXLEnv(t *testing.T) {
	env := EnvFromMap(map[string]string{EnvUseMPI: "1"})
	f, err := LoadBytes("w.yaml", []byte("cache_transceiver_config:\n  backend: DEFAULT\n"), env)
	if err != nil {
		t.Fatal(err)
	}
	r := f.Worker.CacheTransceiver.Resolve(func(Backend) error { return nil })
	if r.Backend != BackendMPI || r.Err != nil || r.Warning != "" || !strings.Contains(r.Reason, EnvUseMPI+"=1") || !strings.Contains(r.Reason, "takes the whole world down") {
		t.Errorf("%s=1: %+v", EnvUseMPI, r)
	}
	for _, v := range []string{EnvUseNIXL} {
		env := EnvFromMap(map[string]string{v: "1"})
		f, err := LoadBytes("w.yaml", []byte("cache_transceiver_config:\n  backend: DEFAULT\n"), env)
		if err != nil {
			t.Fatal(err)
		}
		r := f.Worker.CacheTransceiver.Resolve(func(Backend) error { return nil })
		if r.Backend != BackendAuto || r.Err != nil || !strings.Contains(r.Warning, v+"=1") || !strings.Contains(r.Reason, v+"=1") {
			t.Errorf("%s=1: %+v", v, r)
		}
		if _, err := LoadBytes("w.yaml", []byte("cache_transceiver_config:\n  backend: NIXL\n"), env); err == nil {
			t.Errorf("%s=1: explicit NIXL loaded", v)
		}
	}
}

func TestSenderTimeout(t *testing.T) {
	for _, tc := range []struct {
		fields string
		want   int
		msg    string // "": no warning
		err    bool
	}{
		{"kv_transfer_sender_future_timeout_ms: 2000", 2000, "", false},
		{"kv_transfer_timeout_ms: 1000\n  kv_transfer_sender_future_timeout_ms: 2000", 2000, "has no effect: kv_transfer_timeout_ms (1000) ends the request first", false},
		{"kv_transfer_sender_future_timeout_ms: 0", 0, "0 is out of range", true},
		{"kv_transfer_sender_future_timeout_ms: soon", 0, "want an integer", true},
	} {
		f, err := loadText(t, "cache_transceiver_config:\n  backend: TCP\n  "+tc.fields+"\n")
		if tc.err {
			if err == nil || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("%q: error %v, want %q", tc.fields, err, tc.msg)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", tc.fields, err)
		}
		ct := f.Worker.CacheTransceiver
		if ct.SenderFutureTimeoutMs != tc.want || ct.SenderTimeout().Milliseconds() != int64(tc.want) || warned(f, "cache_transceiver_config."+keySenderTimeout, tc.msg) != (tc.msg != "") {
			t.Errorf("%q: %d, warnings %v", tc.fields, ct.SenderFutureTimeoutMs, f.Warnings)
		}
	}
}

// TestNotApplied: every accepted setting without an effect is a warning of
// kind KindNotApplied, so that config check can list them.
func TestNotApplied(t *testing.T) {
	env := EnvFromMap(map[string]string{EnvUCXInterface: "eth0", "TRTLLM_NIXL_KVCACHE_BACKEND": "UCX"}).WithInterfaces("lo", "eth0")
	text := `hostname: localhost
conditional_disagg_config: {max_local_prefill_length: 64}
context_servers:
  router: {type: kv_cache_aware}
  cache_transceiver_config: {backend: UCX, transceiver_runtime: PYTHON, kv_transfer_sender_future_timeout_ms: 500}
generation_servers:
  cache_transceiver_config: {backend: UCX}
`
	f, err := LoadBytes("c.yaml", []byte(text), env)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, w := range f.NotApplied() {
		got = append(got, w.Path)
	}
	// conditional_disagg_config and router.type kv_cache_aware are applied:
	// not listed.
	want := []string{"env TRTLLM_NIXL_KVCACHE_BACKEND", "context_servers.cache_transceiver_config.transceiver_runtime"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("not applied:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestEnvWithoutEffect: a transfer-path variable whose value TensorRT-LLM
// would ignore (a flag not 1, a count its flag does not turn on) loads, as
// upstream, with a warning of kind KindNotApplied naming it, rather than
// without a word.
func TestEnvWithoutEffect(t *testing.T) {
	for _, tc := range []struct {
		env       map[string]string
		name, msg string
	}{
		{map[string]string{EnvRequestConcurrent: "true"}, EnvRequestConcurrent, "only the value 1 turns it on"},
		{map[string]string{EnvRecvBufferCount: "4"}, EnvRecvBufferCount, EnvRequestConcurrent + "=1"},
		{map[string]string{EnvRequestConcurrent: "0", EnvRecvBufferCount: "4"}, EnvRecvBufferCount, EnvRequestConcurrent + "=1"},
	} {
		f, err := LoadBytes("w.yaml", []byte("cache_transceiver_config: {backend: TCP}\n"), EnvFromMap(tc.env))
		if err != nil {
			t.Errorf("env %v: %v", tc.env, err)
			continue
		}
		found := false
		for _, w := range f.NotApplied() {
			found = found || (w.Path == "env "+tc.name && strings.Contains(w.Msg, tc.msg))
		}
		if !found {
			t.Errorf("env %v: no not-applied warning on %s containing %q; warnings %v", tc.env, tc.name, tc.msg, f.Warnings)
		}
	}
	// Set to what turns them on: no warning.
	f, err := LoadBytes("w.yaml", []byte("cache_transceiver_config: {backend: TCP}\n"),
		EnvFromMap(map[string]string{EnvRequestConcurrent: "1", EnvRecvBufferCount: "4"}))
	if err != nil || len(f.NotApplied()) != 0 {
		t.Errorf("concurrent receive with 4 buffers: %v, not applied %v", err, f.NotApplied())
	}
}

// TestRouterArgs: the router keys kvxfer applies are read with their
// defaults; the ones it does not use are warnings; bad values are errors.
func TestRouterArgs(t *testing.T) {
	def := DefaultRouterArgs()
	for _, tc := range []struct {
		name, router string
		want         RouterArgs
		policy       string
		warn, err    string
	}{
		{"defaults", `{type: kv_cache_aware}`, def, RouterKVCacheAware, "", ""},
		{"upper case", `{type: CONVERSATION, max_sessions: 4096}`, RouterArgs{64, 128, 4096, 0.75, 0}, RouterConversation, "", ""},
		{"all", `{type: conversation, max_sessions: 2, tokens_per_block: 16, match_threshold: 0.5, hash_skip_count: 100, max_batch_size: 8}`,
			RouterArgs{8, 16, 2, 0.5, 100}, RouterConversation, "", ""},
		{"threshold 1", `{type: conversation, match_threshold: 1}`, RouterArgs{64, 128, 100000, 1, 0}, RouterConversation, "", ""},
		{"not used", `{type: load_balancing, use_tokens: true}`, def, RouterLoadBalancing, "context_servers.router.use_tokens", ""},
		{"threshold 0", `{type: conversation, match_threshold: 0}`, def, "", "", "match_threshold: 0 is out of range"},
		{"threshold text", `{type: conversation, match_threshold: high}`, def, "", "", "match_threshold: want a number"},
		{"max_sessions 0", `{type: conversation, max_sessions: 0}`, def, "", "", "max_sessions: 0 is out of range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			text := "context_servers:\n  router: " + tc.router + "\n  cache_transceiver_config: {backend: DEFAULT}\ngeneration_servers:\n  cache_transceiver_config: {backend: DEFAULT}\n"
			f, err := LoadBytes("c.yaml", []byte(text), EnvFromMap(nil))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			g := f.Cluster.Context
			if g.Router != tc.policy || g.RouterArgs != tc.want {
				t.Errorf("router %q %+v, want %q %+v", g.Router, g.RouterArgs, tc.policy, tc.want)
			}
			if f.Cluster.Generation.RouterArgs != def {
				t.Errorf("generation_servers' router args %+v, want the defaults", f.Cluster.Generation.RouterArgs)
			}
			warned := false
			for _, w := range f.Warnings {
				warned = warned || w.Path == tc.warn
			}
			if tc.warn != "" && !warned {
				t.Errorf("no warning at %s: %v", tc.warn, f.Warnings)
			}
		})
	}
}

// TestKVCacheAwareWithoutEvents: kv_cache_aware on a group whose workers
// keep no events (or reuse nothing) is a warning that names the key.
func TestKVCacheAwareWithoutEvents(t *testing.T) {
	for _, tc := range []struct{ kv, want string }{
		{"{}", "event_buffer_max_size 0"},
		{"{enable_block_reuse: false, event_buffer_max_size: 64}", "enable_block_reuse false"},
		{"{event_buffer_max_size: 64}", ""},
	} {
		text := "context_servers:\n  router: {type: kv_cache_aware}\n  kv_cache_config: " + tc.kv + "\ngeneration_servers: {}\n"
		f, err := LoadBytes("c.yaml", []byte(text), Env{})
		if err != nil {
			t.Fatalf("%s: %v", text, err)
		}
		var got string
		for _, w := range f.Warnings {
			if strings.Contains(w.String(), "kv_cache_aware reads") {
				got = w.String()
			}
		}
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) || (got != "" && !strings.Contains(got, "context_servers.router.type")) {
			t.Errorf("kv_cache_config %s: warning %q, want one naming %q", tc.kv, got, tc.want)
		}
	}
}
