package serve

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	"github.com/kvxfer/kvxfer/membership"
)

// MemberRecord is the worker's disagg_cluster registration with url as
// its advertised HTTP URL: its role, model, TP/PP/DP, the fingerprint of
// its cache layout and its transceiver backend. A worker of role both
// does not register (the router would send it context_only and
// generation_only requests alike): an error.
func (w *Worker) MemberRecord(url string) (membership.Record, error) {
	var role membership.Role
	switch w.role {
	case RoleContext:
		role = membership.RoleContext
	case RoleGeneration:
		role = membership.RoleGeneration
	default:
		return membership.Record{}, fmt.Errorf("serve: a worker of role %s does not join a disagg_cluster: start it with --role context or generation", w.role)
	}
	st := w.eng.State()
	dp := 1
	if st.Parallel.AttentionDP && st.Parallel.DPSize > 1 {
		dp = st.Parallel.DPSize
	}
	rec := membership.Record{Role: role, URL: url, Model: w.model,
		Layout: membership.Layout{TP: st.Parallel.TP, PP: st.Parallel.PP, DP: dp}, LayoutFingerprint: LayoutFingerprint(w), Incarnation: membership.NewIncarnation()}
	if w.tr != nil {
		rec.Backends = []string{string(w.tr.Resolution().Backend)}
	}
	return rec, rec.Validate()
}

// LayoutFingerprint is the first 16 hex digits of the SHA-256 of the
// worker's CacheState in its binary form (layout.CacheState.MarshalBinary,
// DP rank 0): two workers whose fingerprints are equal hold their KV
// cache alike.
func LayoutFingerprint(w *Worker) string {
	st := w.eng.State()
	st.Parallel.DPRank = 0
	b, err := st.MarshalBinary()
	if err != nil {
		return ""
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}
