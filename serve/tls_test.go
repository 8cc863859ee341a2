package serve

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
)

// newTLSWorker starts a worker whose HTTP API and transceiver use mutual
// TLS with party c, as kvxfer serve --tls-* does; the server's TLS
// handshake errors go to errs.
func newTLSWorker(t *testing.T, role string, c *tlsconf.Config, errs io.Writer) *httptest.Server {
	t.Helper()
	wc := &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: 4096}}
	ct, err := config.NewCacheTransceiver("tcp", 16, config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	ct.KVTransferTimeoutMs = 10_000
	wc.CacheTransceiver = ct
	w, err := NewWorker(context.Background(), WorkerOptions{Role: role, Model: "tiny-gqa", Config: wc, TLS: c})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(w.Handler())
	srv.TLS = c.Server
	srv.Config.ErrorLog = log.New(errs, "", 0)
	srv.StartTLS()
	t.Cleanup(func() {
		srv.Close()
		(&testWorker{w: w, srv: srv}).waitIdle(t)
		w.Close()
	})
	return srv
}

// TestWorkerTLS: a worker with TLS refuses a plain HTTP client, a client
// without a certificate and one with a certificate of another CA (each with
// a log line), and answers a member of its cluster; a router with TLS
// reaches its workers, and the disaggregated path gives the aggregated
// answer.
func TestWorkerTLS(t *testing.T) {
	ca, err := tlsconf.NewAuthority("serve test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	other, err := tlsconf.NewAuthority("other CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	party := func(a *tlsconf.Authority, name string) *tlsconf.Config {
		c, err := a.Party(name, nil, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	var errs syncbuf.Buffer
	prefillSrv := newTLSWorker(t, RoleContext, party(ca, "ctx"), &errs)
	genSrv := newTLSWorker(t, RoleGeneration, party(ca, "gen"), io.Discard)
	if !strings.HasPrefix(prefillSrv.URL, "https://") {
		t.Fatalf("worker URL %s", prefillSrv.URL)
	}

	router := party(ca, "router")
	noCert := router.Client.Clone()
	noCert.Certificates = nil
	strangerCert := party(other, "stranger").Client.Certificates[0]
	stranger := router.Client.Clone()
	stranger.Certificates = nil
	stranger.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		return &strangerCert, nil // sent although the worker asks for its CA
	}
	for _, tc := range []struct {
		name string
		url  string
		cfg  *tls.Config
		log  string // in the worker's error log
	}{
		{"plain HTTP", strings.Replace(prefillSrv.URL, "https://", "http://", 1), nil, "client sent an HTTP request to an HTTPS server"},
		{"no client certificate", prefillSrv.URL, noCert, "client didn't provide a certificate"},
		{"client certificate of another CA", prefillSrv.URL, stranger, "certificate signed by unknown authority"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: tc.cfg}}
			defer c.CloseIdleConnections()
			resp, err := c.Get(tc.url + "/health")
			if err == nil {
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					t.Fatalf("worker answered: %d %s", resp.StatusCode, body)
				}
			}
			deadline := time.Now().Add(5 * time.Second)
			for !strings.Contains(errs.String(), tc.log) {
				if time.Now().After(deadline) {
					t.Fatalf("worker log lacks %q:\n%s", tc.log, errs.String())
				}
				time.Sleep(5 * time.Millisecond) // polling a log: no event to wait on
			}
		})
	}
	t.Run("member", func(t *testing.T) {
		c := NewHTTPClient(router.Client)
		defer c.CloseIdleConnections()
		resp, err := c.Get(prefillSrv.URL + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("health: %d", resp.StatusCode)
		}
	})

	t.Run("router", func(t *testing.T) {
		hostPort := func(u string) string { return strings.TrimPrefix(u, "https://") }
		r, err := NewRouter(RouterOptions{Context: []string{hostPort(prefillSrv.URL)}, Generation: []string{genSrv.URL}, TLS: router.Client})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		rs := httptest.NewServer(r.Handler())
		defer rs.Close()
		defer http.DefaultClient.CloseIdleConnections()
		resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"The quick brown fox","max_tokens":8,"temperature":0,"ignore_eos":true,"return_token_ids":true}`)
		var c completion
		json.Unmarshal([]byte(body), &c)
		if resp.StatusCode != http.StatusOK || len(c.Choices) != 1 || len(c.Choices[0].TokenIDs) != 8 || c.Usage.CompletionTokens != 8 {
			t.Fatalf("through the router: %d %s, want 8 token ids", resp.StatusCode, body)
		}
		if _, err := NewRouter(RouterOptions{Context: []string{"http://" + hostPort(prefillSrv.URL)}, Generation: []string{genSrv.URL}, TLS: router.Client}); err == nil ||
			!strings.Contains(err.Error(), "plain http") {
			t.Errorf("router with TLS and an http:// worker URL: %v, want a refusal", err)
		}
	})
}
