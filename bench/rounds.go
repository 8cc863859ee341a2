package bench

import (
	"fmt"
	"slices"
	"strings"
)

// A sweep of Sweep.Rounds rounds measures in turns: round k measures every
// baseline once, then every run once (each run with its own context
// process and warm-up, as a sweep of one round does). A baseline's and a
// run's figure is then the best of its rounds, and each run's ratio to a
// baseline is reported twice: best over best (Result.Ratios) and the
// median of the per-round ratios, round k's run over round k's baseline
// (Result.MedianRoundRatios), two figures measured within a minute of each
// other. This file is the bookkeeping, without any measuring: it merges
// the rounds of a run or of a baseline into one row.

// RunRound is one round's figures of a run (Result.Rounds).
type RunRound struct {
	Requests      int     `json:"requests"` // measured requests that completed in this round
	Bytes         int64   `json:"bytes"`
	MeasuredS     float64 `json:"measured_s"`
	GBps          float64 `json:"gbps"`
	TransfersPerS float64 `json:"transfers_per_s"`
	P50Ms         float64 `json:"p50_ms"`
	P99Ms         float64 `json:"p99_ms"`
	Errors        int     `json:"errors"`
	// Error is the round's own Result.Error: why it could not be set up
	// or was cut short.
	Error string `json:"error,omitempty"`
	// Ratios are this round's GBps over the same round's figure of each
	// measured baseline that applies to the run.
	Ratios []Ratio `json:"ratios,omitempty"`
}

// BaselineRound is one round's figure of a baseline (Baseline.Rounds).
type BaselineRound struct {
	GBps  float64 `json:"gbps"` // 0 when it failed
	Error string  `json:"error,omitempty"`
}

// roundPrefix is what the messages of round k (0-based) of n start with:
// nothing when there is one round.
func roundPrefix(k, n int) string {
	if n <= 1 {
		return ""
	}
	return fmt.Sprintf("round %d of %d: ", k+1, n)
}

// mergeRuns makes one row of the rounds of a run in a sweep of n rounds,
// rs[k] being round k's row (a round that could not be set up is a row
// with its error, as RunSweep makes it; a run that failed has no rows for
// the rounds after). The row's figure (GBps, TransfersPerS) is its best
// round's; Requests, Bytes, MeasuredS, Errors and the context side's
// counts are the sums over the rounds; the latency percentiles are of
// every round's requests pooled; every round's error is kept, prefixed by
// its round, so a round that failed fails the row. With one round the row
// is that round's, with Rounds added.
func mergeRuns(rs []*Result, n int) *Result {
	first := rs[0]
	out := &Result{RequestedBackend: first.RequestedBackend, Model: first.Model, ISL: first.ISL, DType: first.DType,
		Concurrency: first.Concurrency, Ctx: first.Ctx, Gen: first.Gen, MLA: first.MLA, TLS: first.TLS,
		BytesPerReq: first.BytesPerReq, ProcessPerRank: first.ProcessPerRank, Verification: first.Verification}
	var backends []string
	best := -1
	for k, r := range rs {
		out.Rounds = append(out.Rounds, RunRound{Requests: r.Requests, Bytes: r.Bytes, MeasuredS: r.MeasuredS, GBps: r.GBps,
			TransfersPerS: r.TransfersPerS, P50Ms: r.P50Ms, P99Ms: r.P99Ms, Errors: r.Errors, Error: r.Error})
		for b := range strings.SplitSeq(r.Backend, "+") {
			if b != "" && !slices.Contains(backends, b) {
				backends = append(backends, b)
			}
		}
		out.Requests += r.Requests
		out.Bytes += r.Bytes
		out.MeasuredS += r.MeasuredS
		out.Errors += r.Errors
		out.PeerFailed += r.PeerFailed
		out.PeerLeaked += r.PeerLeaked
		if out.BytesPerReq == 0 {
			out.BytesPerReq = r.BytesPerReq
		}
		p := roundPrefix(k, n)
		if r.Error != "" {
			if out.Error == "" {
				out.Error = p + r.Error
			} else {
				out.ErrorMessages = append(out.ErrorMessages, p+r.Error)
			}
		}
		for _, m := range r.ErrorMessages {
			out.ErrorMessages = append(out.ErrorMessages, p+m)
		}
		out.Verification = worseVerification(out.Verification, r.Verification)
		out.lat = append(out.lat, r.lat...)
		out.agree = append(out.agree, r.agree...)
		out.ctxAgree = append(out.ctxAgree, r.ctxAgree...)
		if r.GBps > 0 && (best < 0 || r.GBps > rs[best].GBps) {
			best = k
		}
	}
	out.Backend = strings.Join(backends, "+")
	out.Verified = out.Verification == VerifyPassed && out.Errors == 0
	if best >= 0 {
		out.GBps, out.TransfersPerS = rs[best].GBps, rs[best].TransfersPerS
	}
	if len(rs) == 1 {
		// One round: its own figures, exactly as a sweep without rounds.
		out.P50Ms, out.P99Ms = first.P50Ms, first.P99Ms
		out.AgreementP50Us, out.AgreementP99Us = first.AgreementP50Us, first.AgreementP99Us
		out.CtxAgreementP50Us, out.CtxAgreementP99Us = first.CtxAgreementP50Us, first.CtxAgreementP99Us
		out.Verified = first.Verified
		return out
	}
	out.P50Ms, out.P99Ms = percentile(out.lat, 50), percentile(out.lat, 99)
	out.AgreementP50Us, out.AgreementP99Us = percentile(out.agree, 50), percentile(out.agree, 99)
	out.CtxAgreementP50Us, out.CtxAgreementP99Us = percentile(out.ctxAgree, 50), percentile(out.ctxAgree, 99)
	return out
}

// verificationRank orders the verification outcomes from the best to the
// worst: a row of several rounds says the worst of them.
var verificationRank = []string{VerifyOff, VerifyPassed, VerifySkipped, VerifyNotRun, VerifyFailed}

func worseVerification(a, b string) string {
	if slices.Index(verificationRank, b) > slices.Index(verificationRank, a) {
		return b
	}
	return a
}

// mergeBaselines makes one list of the rounds of the baselines, rounds[k]
// being round k's list. A baseline is the record of its best round (its
// settings searched, the winner and its command) with Rounds, every
// round's figure, and the best of them as its figure. A baseline that was
// measured in one round and failed in another has no figure (GBps 0): its
// Error names the rounds that failed, and no ratio is taken to it. One
// skipped, or failed, in the first round is not measured again and has no
// rounds after it.
func mergeBaselines(rounds [][]Baseline) []Baseline {
	if len(rounds) == 0 {
		return []Baseline{}
	}
	n := len(rounds)
	out := make([]Baseline, 0, len(rounds[0]))
	for _, first := range rounds[0] {
		b := first
		b.Rounds = nil
		switch {
		case first.Skipped != "":
			out = append(out, b)
			continue
		case first.GBps <= 0: // failed in the first round: not measured again
			b.Rounds = []BaselineRound{{Error: first.Error}}
			b.Error = roundPrefix(0, n) + first.Error
			out = append(out, b)
			continue
		}
		var errs []string
		best := 0.0
		for k, round := range rounds {
			r := Baseline{Error: "not measured in this round"}
			if j := slices.IndexFunc(round, func(o Baseline) bool { return o.Name == first.Name }); j >= 0 {
				r = round[j]
			}
			b.Rounds = append(b.Rounds, BaselineRound{GBps: r.GBps, Error: r.Error})
			switch {
			case r.GBps > best:
				best = r.GBps
				b.Variants, b.Best, b.Command = r.Variants, r.Best, r.Command
			case r.GBps > 0: // a figure, not the best
			case r.Error != "":
				errs = append(errs, roundPrefix(k, n)+r.Error)
			default:
				errs = append(errs, roundPrefix(k, n)+"no figure")
			}
		}
		b.GBps, b.Error = best, ""
		if len(errs) > 0 {
			b.GBps, b.Error = 0, strings.Join(errs, "; ")
		}
		if n > 1 && b.GBps > 0 {
			b.Description += fmt.Sprintf("; best of %d rounds", n)
			if len(first.Variants) > 1 {
				b.Description += " (every setting tried in every round)"
			}
		}
		out = append(out, b)
	}
	return out
}

// roundRatios sets r.Rounds[k].Ratios, round k's figure over round k's of
// each baseline in ratios(r, bs), and returns, per baseline, the median of
// those that both sides measured (none when no round has both).
func roundRatios(r *Result, bs []Baseline) []Ratio {
	for k := range r.Rounds {
		r.Rounds[k].Ratios = nil
	}
	var medians []Ratio
	for _, q := range ratios(r, bs) {
		i := slices.IndexFunc(bs, func(b Baseline) bool { return b.Name == q.Baseline })
		var per []float64
		for k := range r.Rounds {
			rr := &r.Rounds[k]
			if k >= len(bs[i].Rounds) || rr.GBps <= 0 || bs[i].Rounds[k].GBps <= 0 {
				continue
			}
			v := rr.GBps / bs[i].Rounds[k].GBps
			rr.Ratios = append(rr.Ratios, Ratio{Baseline: q.Baseline, Ratio: v})
			per = append(per, v)
		}
		if len(per) > 0 {
			medians = append(medians, Ratio{Baseline: q.Baseline, Ratio: median(per)})
		}
	}
	return medians
}

// median is the middle of xs, or the mean of its two middles (0 for
// none).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := len(s) / 2
	if len(s)%2 == 1 {
		return s[m]
	}
	return (s[m-1] + s[m]) / 2
}
