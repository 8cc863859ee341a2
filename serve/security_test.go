package serve

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/transceiver"
)

var serveSecret = bytes.Repeat([]byte("0123456789abcdef"), 2)

// newSecureWorker is a TCP worker with the given secret (nil: none) and
// kv_transfer_timeout_ms.
func newSecureWorker(t *testing.T, role string, secret []byte, timeoutMs int, peers ...string) *testWorker {
	t.Helper()
	ct, err := config.NewCacheTransceiver("tcp", 16, config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	ct.KVTransferTimeoutMs = timeoutMs
	wc := &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: 4096},
		CacheTransceiver: ct}
	return startTestWorker(t, WorkerOptions{Role: role, Model: "tiny-gqa", Config: wc, Secret: secret, AllowedPeerHosts: peers})
}

// contextPhase runs a context_only request and returns what the router
// would forward to a generation worker.
func contextPhase(t *testing.T, prefillW *testWorker, prompt string) map[string]any {
	t.Helper()
	code, c, raw := postJSON(t, prefillW.srv.URL+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 4,
		"disaggregated_params": map[string]any{"request_type": "context_only"}})
	if code != 200 || len(c.Choices) == 0 || c.Choices[0].Disagg == nil {
		t.Fatalf("context phase: %d %s", code, raw)
	}
	dp := *c.Choices[0].Disagg
	dp.RequestType = TypeGenerationOnly
	return map[string]any{"prompt": c.PromptTokenIDs, "max_tokens": 4, "disaggregated_params": dp}
}

func withOpaque(body map[string]any, opaque []byte) map[string]any {
	dp := body["disaggregated_params"].(DisaggregatedParams)
	dp.EncodedOpaqueState = base64.StdEncoding.EncodeToString(opaque)
	out := map[string]any{}
	for k, v := range body {
		out[k] = v
	}
	out["disaggregated_params"] = dp
	return out
}

func opaqueOf(t *testing.T, body map[string]any) []byte {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(body["disaggregated_params"].(DisaggregatedParams).EncodedOpaqueState)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestHostileOpaqueStatesHTTP: a generation worker with the cluster secret
// answers forged, replayed, unsigned and expired opaque states, and states
// naming hosts it may not dial, with the documented 4xx and error type, takes
// no blocks for them (the cleanup checks the pools), and keeps serving
// genuine requests.
func TestHostileOpaqueStatesHTTP(t *testing.T) {
	prefillW := newSecureWorker(t, RoleContext, serveSecret, 10_000)
	genW := newSecureWorker(t, RoleGeneration, serveSecret, 10_000)
	url := genW.srv.URL + "/v1/completions"
	expect := func(name string, body map[string]any, code int, typ string) {
		t.Helper()
		got, c, raw := postJSON(t, url, body)
		if got != code || c.Error == nil || c.Error.Type != typ {
			t.Errorf("%s: %d %s, want %d %s", name, got, raw, code, typ)
		}
	}
	genuine := func(name string) {
		t.Helper()
		if code, _, raw := postJSON(t, url, contextPhase(t, prefillW, "genuine after "+name)); code != 200 {
			t.Fatalf("genuine request after %s: %d %s", name, code, raw)
		}
	}

	body := contextPhase(t, prefillW, "forge me")
	forged := opaqueOf(t, body)
	i := bytes.Index(forged, []byte("127.0.0.1:"))
	if i < 0 {
		t.Fatal("no endpoint in the opaque state")
	}
	forged[i+len("127.0.0.1:")] ^= 1 // another port
	expect("forged endpoint", withOpaque(body, forged), http.StatusForbidden, "opaque_state_forged")
	if code, _, raw := postJSON(t, url, body); code != 200 {
		t.Fatalf("the genuine state after its forgery: %d %s", code, raw)
	}
	expect("replayed", body, http.StatusForbidden, "opaque_state_replayed")
	genuine("a replay")

	plainCtx := newSecureWorker(t, RoleContext, nil, 1_000)
	expect("unsigned", contextPhase(t, plainCtx, "unsigned"), http.StatusForbidden, "opaque_state_unsigned")
	genuine("an unsigned state")

	quickCtx := newSecureWorker(t, RoleContext, serveSecret, 1)
	body = contextPhase(t, quickCtx, "expire me")
	var op transceiver.OpaqueState
	if err := op.UnmarshalBinary(opaqueOf(t, body)); err != nil || !op.Signed {
		t.Fatalf("signed state: %v %+v", err, op)
	}
	time.Sleep(time.Until(op.Expiry) + time.Millisecond) // the expiry is the condition
	expect("expired", body, http.StatusGone, "opaque_state_expired")
	genuine("an expired state")

	// A worker without a secret dials loopback only.
	plainGen := newSecureWorker(t, RoleGeneration, nil, 1_000)
	body = contextPhase(t, plainCtx, "elsewhere")
	if err := op.UnmarshalBinary(opaqueOf(t, body)); err != nil {
		t.Fatal(err)
	}
	op.Endpoints = []string{"10.255.255.1:9"}
	elsewhere, err := op.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	got, c, raw := postJSON(t, plainGen.srv.URL+"/v1/completions", withOpaque(body, elsewhere))
	if got != http.StatusForbidden || c.Error == nil || c.Error.Type != "peer_not_allowed" || !strings.Contains(raw, "10.255.255.1") {
		t.Errorf("non-loopback endpoint: %d %s", got, raw)
	}
	if code, _, raw := postJSON(t, plainGen.srv.URL+"/v1/completions", body); code != 200 {
		t.Fatalf("loopback pull without a secret: %d %s", code, raw)
	}
}

func TestStatusOfSecurityErrors(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code int
		typ  string
	}{
		{transceiver.ErrUnsignedOpaqueState, 403, "opaque_state_unsigned"},
		{transceiver.ErrForgedOpaqueState, 403, "opaque_state_forged"},
		{transceiver.ErrReplayedOpaqueState, 403, "opaque_state_replayed"},
		{transceiver.ErrPeerNotAllowed, 403, "peer_not_allowed"},
		{transceiver.ErrExpiredOpaqueState, 410, "opaque_state_expired"},
		{transceiver.ErrReplayCacheFull, 503, "replay_cache_full"},
		{transceiver.ErrBadOpaqueState, 400, "invalid_request_error"},
	} {
		// As the engine reports a failed transfer start.
		err := fmt.Errorf("%w: request 1: %w", engine.ErrTransfer, fmt.Errorf("transceiver: receive: %w", tc.err))
		if code, typ := statusOf(err); code != tc.code || typ != tc.typ {
			t.Errorf("%v: %d %s, want %d %s", tc.err, code, typ, tc.code, tc.typ)
		}
		if !errors.Is(err, tc.err) {
			t.Fatal("test error does not wrap")
		}
	}
}
