package memstore

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// FuzzDecodeRequest: no request body makes the decoder panic, and what it
// accepts passes its own checks.
func FuzzDecodeRequest(f *testing.F) {
	for _, s := range []struct{ name, body string }{
		{"grant", `{"ttl_ms":1000}`}, {"keepalive", `{"lease":3}`}, {"revoke", `{"lease":3}`},
		{"put", `{"key":"/k","value":"dg==","lease":0}`}, {"list", `{"prefix":"/"}`},
		{"watch", `{"prefix":"/","from":4,"wait_ms":10}`}, {"put", `{"key":"\u0000"}`}, {"x", `{}`},
	} {
		f.Add(s.name, []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, name string, body []byte) {
		v, err := decodeRequest(name, bytes.NewReader(body))
		if err != nil {
			return
		}
		switch q := v.(type) {
		case *putReq:
			if checkKey(q.Key) != nil {
				t.Fatalf("accepted key %q", q.Key)
			}
		case *watchReq:
			if q.From < 0 || q.WaitMs < 0 {
				t.Fatalf("accepted %+v", q)
			}
		case *grantReq:
			if q.TTLMs <= 0 {
				t.Fatalf("accepted %+v", q)
			}
		}
	})
}

// FuzzHandler: any call to the handler gets an answer, never a panic, on a
// store with small bounds.
func FuzzHandler(f *testing.F) {
	f.Add("put", []byte(`{"key":"/k","value":"dg=="}`))
	f.Add("watch", []byte(`{"prefix":"/","from":1,"wait_ms":1}`))
	f.Add("grant", []byte(`{"ttl_ms":5}`))
	f.Add("list", []byte(`{"prefix":""}`))
	s := New(Options{MaxKeys: 8, MaxLeases: 8, MaxWatchers: 2, History: 8, MaxTTL: time.Second})
	defer s.Close()
	h := Handler(s, HandlerOptions{MaxWait: 5 * time.Millisecond})
	f.Fuzz(func(t *testing.T, name string, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "http://x/", bytes.NewReader(body))
		req.URL.Path = BasePath + "/" + name
		w := httptest.NewRecorder()
		start := time.Now()
		h.ServeHTTP(w, req)
		if el := time.Since(start); el > 2*time.Second {
			t.Fatalf("%s %q: answered after %v", name, body, el)
		}
		if w.Code == 0 || w.Code >= 500 {
			t.Fatalf("%s %q: status %d %s", name, body, w.Code, w.Body)
		}
	})
}

// FuzzDecodeAnswer: the client's decoding of answers (and of error bodies)
// never panics, and an event it accepts has a type and a revision.
func FuzzDecodeAnswer(f *testing.F) {
	f.Add([]byte(`{"events":[{"type":"put","key":"/k","value":"dg==","rev":3}],"next":4}`))
	f.Add([]byte(`{"code":"compacted","error":"x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var r watchResp
		if decodeJSON(bytes.NewReader(b), maxResponseBody, &r) == nil {
			for _, e := range r.Events {
				if ev, err := eventOf(e); err == nil && (ev.Type == 0 || ev.Rev <= 0) {
					t.Fatalf("accepted %+v", ev)
				}
			}
		}
		var l listResp
		_ = decodeJSON(bytes.NewReader(b), maxResponseBody, &l)
		_ = decodeError(410, bytes.NewReader(b))
	})
}
