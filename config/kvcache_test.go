package config

import (
	"bytes"
	"strings"
	"testing"
)

// TestKVCacheReuseKeys: the block reuse keys of kv_cache_config load with
// TensorRT-LLM's defaults (reuse on, partial reuse by copy on, no events),
// reject what is not a boolean or a size in range, and print back to the
// same value.
func TestKVCacheReuseKeys(t *testing.T) {
	tests := []struct {
		name                 string
		yaml                 string
		block, partial, copy bool
		events               int
		err                  string // a substring of the load error; "" for none
	}{
		{"defaults", "kv_cache_config:\n  max_tokens: 4096\n", true, true, true, 0, ""},
		{"no kv_cache_config", "tensor_parallel_size: 1\n", true, true, true, 0, ""},
		{"reuse off", "kv_cache_config:\n  enable_block_reuse: false\n", false, true, true, 0, ""},
		{"partial off", "kv_cache_config:\n  enable_partial_reuse: false\n  copy_on_partial_reuse: false\n", true, false, false, 0, ""},
		{"events", "kv_cache_config:\n  event_buffer_max_size: 1024\n", true, true, true, 1024, ""},
		{"null leaves the default", "kv_cache_config:\n  enable_block_reuse: null\n", true, true, true, 0, ""},
		{"not a boolean", "kv_cache_config:\n  enable_block_reuse: 1\n", false, false, false, 0, "kv_cache_config.enable_block_reuse"},
		{"negative events", "kv_cache_config:\n  event_buffer_max_size: -1\n", false, false, false, 0, "kv_cache_config.event_buffer_max_size"},
		{"too many events", "kv_cache_config:\n  event_buffer_max_size: 2000000\n", false, false, false, 0, "out of range"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := LoadBytes("w.yaml", []byte(tc.yaml), EnvFromMap(nil))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("load: %v, want an error naming %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			kv := f.Worker.KVCache
			block, partial, cp := kv.Reuse()
			if block != tc.block || partial != tc.partial || cp != tc.copy || kv.EventBufferMaxSize != tc.events {
				t.Errorf("Reuse() = %v %v %v, events %d; want %v %v %v, %d", block, partial, cp, kv.EventBufferMaxSize,
					tc.block, tc.partial, tc.copy, tc.events)
			}
			var buf bytes.Buffer
			if err := f.Format(&buf); err != nil {
				t.Fatal(err)
			}
			g, err := LoadBytes("printed.yaml", buf.Bytes(), EnvFromMap(nil))
			if err != nil {
				t.Fatalf("printed config does not load: %v\n%s", err, buf.String())
			}
			kv2 := g.Worker.KVCache
			b2, p2, c2 := kv2.Reuse()
			if b2 != block || p2 != partial || c2 != cp || kv2.EventBufferMaxSize != kv.EventBufferMaxSize ||
				(kv.EnableBlockReuse == nil) != (kv2.EnableBlockReuse == nil) {
				t.Errorf("round trip: %+v, printed and loaded %+v", kv, kv2)
			}
		})
	}
}
