//go:build ucx

package serve

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/config"
	_ "github.com/kvxfer/kvxfer/transport/ucx"
)

// TestDisaggregatedOverUCX: with -tags ucx (make ucx), context TP2 and
// generation TP1 workers whose transceivers use UCX answer through the
// router with the aggregated worker's token ids.
func TestDisaggregatedOverUCX(t *testing.T) {
	ucx := func(ct *config.CacheTransceiver) { ct.Backend = config.BackendUCX }
	prefillW := newTestWorker(t, RoleContext, "tiny-gqa", 2, 1, ucx)
	genW := newTestWorker(t, RoleGeneration, "tiny-gqa", 1, 1, ucx)
	agg := newTestWorker(t, RoleBoth, "tiny-gqa", 1, 1)
	rs := newTestRouter(t, []string{prefillW.srv.URL}, []string{genW.srv.URL}, RoundRobin)
	body := map[string]any{"prompt": "The quick brown fox, over several blocks of the cache", "max_tokens": 16,
		"ignore_eos": true, "return_token_ids": true}
	_, want, raw := postJSON(t, agg.srv.URL+"/v1/completions", body)
	if len(want.Choices) != 1 || len(want.Choices[0].TokenIDs) != 16 {
		t.Fatalf("aggregated: %s", raw)
	}
	code, got, raw := postJSON(t, rs.URL+"/v1/completions", body)
	if code != 200 || len(got.Choices) != 1 || !slices.Equal(got.Choices[0].TokenIDs, want.Choices[0].TokenIDs) {
		t.Fatalf("over UCX: %d %s, want ids %v", code, raw, want.Choices[0].TokenIDs)
	}
	mfs, err := genW.w.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var carried []string
	for _, mf := range mfs {
		if mf.GetName() != "kvxfer_transfer_bytes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "backend" && m.GetCounter().GetValue() > 0 {
					carried = append(carried, l.GetValue())
				}
			}
		}
	}
	if len(carried) == 0 || !strings.HasPrefix(carried[0], "ucx") || len(carried) > 1 {
		t.Errorf("the generation worker's bytes were carried by %v, want ucx only", carried)
	}
}
