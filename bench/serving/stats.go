package serving

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Record is what was measured of one request.
type Record struct {
	Conversation, Turn int
	// Sent is when the request was sent, from the start of the run.
	Sent time.Duration
	// PromptTokens is the prompt's length; MaxTokens the answer's
	// requested length; OutputTokens the tokens that came
	// (usage.completion_tokens, else the ids counted in the chunks).
	PromptTokens, MaxTokens, OutputTokens int
	// TTFT is the time to the first token-carrying chunk, E2EL to the
	// stream's end; ITL the gaps between token-carrying chunks.
	TTFT, E2EL time.Duration
	ITL        []time.Duration
	// Timing is usage.kvxfer_timing, when the answer carried it.
	Timing *Timing
	// CachedTokens is usage.prompt_tokens_details.cached_tokens, when
	// HasCached says the answer carried it.
	CachedTokens int
	HasCached    bool
	// Path is the path class the router named in PathHeader (PathLocal or
	// PathDisaggregated, as sent); "" when the response had no header.
	Path string
	// PromptBlocks is the prompt's length in blocks and NewBlocks the
	// blocks of it beyond what the previous turn of its conversation left
	// cached (NewBlocks), both at Options.TokensPerBlock; 0 when the run
	// has no block size.
	PromptBlocks, NewBlocks int
	// ErrorKind is "" for a request that completed, else one of the
	// Error* kinds; Error is its message.
	ErrorKind, Error string
}

// OK reports whether the request completed.
func (r *Record) OK() bool { return r.ErrorKind == "" }

// Timing is kvxfer's time split of a request (usage.kvxfer_timing).
type Timing struct {
	QueueMs         float64 `json:"queue_ms"`
	PrefillMs       float64 `json:"prefill_ms"`
	KVTransferMs    float64 `json:"kv_transfer_ms"`
	KVTransferBytes int64   `json:"kv_transfer_bytes"`
	// KVTransferBlocks is how many of the prompt's blocks the generation
	// worker asked for (those it did not find in its own cache), and
	// KVBlockBytes the size of one block over its ranks; 0 when the
	// server does not report them.
	KVTransferBlocks int     `json:"kv_transfer_blocks"`
	KVBlockBytes     int64   `json:"kv_block_bytes"`
	FirstDecodeMs    float64 `json:"first_decode_ms"`
	TotalMs          float64 `json:"total_ms"`
}

// The kinds of errors a request ends with.
const (
	ErrorConnect    = "connect"     // no connection to the server
	ErrorHTTP4xx    = "http_4xx"    // the server refused the request
	ErrorHTTP5xx    = "http_5xx"    // the server failed it before streaming
	ErrorEvent      = "error_event" // the stream carried an error event
	ErrorIncomplete = "incomplete"  // the stream ended without [DONE]
	ErrorBadEvent   = "bad_event"   // an event that does not decode
	ErrorTimeout    = "timeout"     // the request's deadline passed
	ErrorCanceled   = "canceled"    // the run was stopped
	ErrorNoTokens   = "no_tokens"   // the stream completed without a token
	ErrorOther      = "other"       // anything else
)

// Dist summarizes a set of samples: mean and percentiles (0 for none).
type Dist struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Max  float64 `json:"max"`
	// N is the number of samples.
	N int `json:"n"`
}

// Percentile returns the p-th percentile (0..100) of sorted, ascending
// samples, interpolating linearly between the closest ranks (numpy's
// default): rank h = (n−1)·p/100. It returns 0 for no samples.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	h := float64(n-1) * p / 100
	lo := int(math.Floor(h))
	if lo >= n-1 {
		return sorted[n-1]
	}
	if lo < 0 {
		return sorted[0]
	}
	return sorted[lo] + (h-float64(lo))*(sorted[lo+1]-sorted[lo])
}

// Summarize returns the Dist of samples (which it sorts in place).
func Summarize(samples []float64) Dist {
	if len(samples) == 0 {
		return Dist{}
	}
	slices.Sort(samples)
	sum := 0.0
	for _, v := range samples {
		sum += v
	}
	return Dist{Mean: sum / float64(len(samples)), P50: Percentile(samples, 50), P90: Percentile(samples, 90),
		P99: Percentile(samples, 99), Max: samples[len(samples)-1], N: len(samples)}
}

// TPOT returns a request's time per output token after the first,
// (E2EL − TTFT) / (tokens − 1), and false for fewer than two tokens.
func TPOT(r *Record) (time.Duration, bool) {
	if r.OutputTokens < 2 {
		return 0, false
	}
	return (r.E2EL - r.TTFT) / time.Duration(r.OutputTokens-1), true
}

// ErrBadSLO: an SLO that cannot be parsed.
var ErrBadSLO = errors.New("serving: bad SLO")

// SLO is a set of service-level objectives in milliseconds; 0 is none.
// A request meets it when every set objective holds: TTFT, TPOT (a
// request with one token has none and meets it) and E2EL.
type SLO struct {
	TTFTMs float64 `json:"ttft_ms,omitempty"`
	TPOTMs float64 `json:"tpot_ms,omitempty"`
	E2ELMs float64 `json:"e2el_ms,omitempty"`
}

// Set reports whether any objective is set.
func (s SLO) Set() bool { return s.TTFTMs > 0 || s.TPOTMs > 0 || s.E2ELMs > 0 }

// ParseSLO parses vllm's --goodput form: "ttft:200 tpot:20", each
// key:milliseconds (keys ttft, tpot, e2el), given as one or several
// strings.
func ParseSLO(args []string) (SLO, error) {
	var s SLO
	for _, a := range args {
		for _, kv := range strings.FieldsFunc(a, func(r rune) bool { return r == ' ' || r == ',' }) {
			k, v, ok := strings.Cut(kv, ":")
			ms, err := strconv.ParseFloat(v, 64)
			if !ok || err != nil || ms <= 0 || math.IsInf(ms, 0) {
				return SLO{}, fmt.Errorf("%w: %q: want key:milliseconds, a positive number (ttft:200 tpot:20 e2el:5000)", ErrBadSLO, kv)
			}
			switch k {
			case "ttft":
				s.TTFTMs = ms
			case "tpot":
				s.TPOTMs = ms
			case "e2el":
				s.E2ELMs = ms
			default:
				return SLO{}, fmt.Errorf("%w: %q: unknown key %q (want ttft, tpot or e2el)", ErrBadSLO, kv, k)
			}
		}
	}
	return s, nil
}

// Meets reports whether a completed request meets s.
func (s SLO) Meets(r *Record) bool {
	if !r.OK() {
		return false
	}
	if s.TTFTMs > 0 && ms(r.TTFT) > s.TTFTMs {
		return false
	}
	if tpot, ok := TPOT(r); ok && s.TPOTMs > 0 && ms(tpot) > s.TPOTMs {
		return false
	}
	return s.E2ELMs <= 0 || ms(r.E2EL) <= s.E2ELMs
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Metrics are a run's figures, named as vllm's.
type Metrics struct {
	Completed int `json:"completed"`
	Failed    int `json:"failed"`
	// ErrorsByKind counts the failed requests by kind (the Error* kinds).
	ErrorsByKind map[string]int `json:"errors_by_kind"`
	// DurationS is the run's length: from its start to the last answer.
	DurationS float64 `json:"duration_s"`
	// TotalInput and TotalOutput are the prompt and output tokens of the
	// completed requests; RequestedOutput the output they asked for.
	TotalInput      int `json:"total_input_tokens"`
	TotalOutput     int `json:"total_output_tokens"`
	RequestedOutput int `json:"requested_output_tokens"`
	// Per second of the run: completed requests, output tokens, prompt and
	// output tokens.
	RequestThroughput    float64 `json:"request_throughput"`
	OutputThroughput     float64 `json:"output_throughput"`
	TotalTokenThroughput float64 `json:"total_token_throughput"`
	// Goodput is the completed requests per second that met the SLO
	// (nil without an SLO); GoodRequests counts them.
	Goodput      *float64 `json:"goodput"`
	GoodRequests int      `json:"good_requests"`
	TTFT         Dist     `json:"ttft_ms"`
	TPOT         Dist     `json:"tpot_ms"`
	ITL          Dist     `json:"itl_ms"`
	E2EL         Dist     `json:"e2el_ms"`
	// From usage.kvxfer_timing of the completed requests that carried it
	// (those that moved KV: a disaggregated one): KV bytes moved per
	// request, the transfer's time, and its share of the request's TTFT
	// (kv_transfer_ms / ttft_ms, 0..1).
	KVBytes      Dist `json:"kv_bytes_per_request"`
	KVTransferMs Dist `json:"kv_transfer_ms"`
	KVShareTTFT  Dist `json:"kv_share_of_ttft"`
	// Prefix reuse (computeReuse), over the completed requests:
	// CachedTokens sums usage.prompt_tokens_details.cached_tokens over the
	// CachedReported requests that carried it; PrefixHitRate is it over
	// their prompt tokens (null when none carried it). NewBlockBytes is
	// the bench's own count of each request's new blocks (NewBlocks)
	// times its block size (blockBytes; for a request that moved no KV,
	// the run's), over the requests whose block size is known
	// (BlockBytesInferred of them derived by the bench); MovedOverNew is
	// the KV moved over the new blocks' bytes, summed over the requests
	// that moved KV (null when none): a request that ran locally is not a
	// transfer and counts in the new bytes only. PerTurn splits them by turn index; ByPath splits TTFT by the
	// path class the router named (empty when no response named one).
	CachedTokens       int           `json:"cached_prompt_tokens"`
	CachedReported     int           `json:"cached_tokens_reported"`
	PrefixHitRate      *float64      `json:"prefix_hit_rate"`
	NewBlockBytes      Dist          `json:"new_block_bytes_per_request"`
	MovedOverNew       *float64      `json:"kv_moved_over_new"`
	BlockBytesInferred int           `json:"kv_block_bytes_inferred"`
	PerTurn            []TurnMetrics `json:"per_turn"`
	ByPath             []PathMetrics `json:"by_path"`
}

// Compute returns the metrics of records over a run of duration d, with
// the goodput under slo when it is set.
func Compute(records []Record, d time.Duration, slo SLO) Metrics {
	m := Metrics{ErrorsByKind: map[string]int{}, DurationS: d.Seconds()}
	var ttft, tpot, itl, e2el, kvBytes, kvMs, kvShare []float64
	for i := range records {
		r := &records[i]
		if !r.OK() {
			m.Failed++
			m.ErrorsByKind[r.ErrorKind]++
			continue
		}
		m.Completed++
		m.TotalInput += r.PromptTokens
		m.TotalOutput += r.OutputTokens
		m.RequestedOutput += r.MaxTokens
		ttft = append(ttft, ms(r.TTFT))
		e2el = append(e2el, ms(r.E2EL))
		if t, ok := TPOT(r); ok {
			tpot = append(tpot, ms(t))
		}
		for _, g := range r.ITL {
			itl = append(itl, ms(g))
		}
		if slo.Set() && slo.Meets(r) {
			m.GoodRequests++
		}
		if t := r.Timing; t != nil && t.KVTransferBytes > 0 {
			kvBytes = append(kvBytes, float64(t.KVTransferBytes))
			kvMs = append(kvMs, t.KVTransferMs)
			if r.TTFT > 0 {
				kvShare = append(kvShare, min(1, t.KVTransferMs/ms(r.TTFT)))
			}
		}
	}
	if s := d.Seconds(); s > 0 {
		m.RequestThroughput = float64(m.Completed) / s
		m.OutputThroughput = float64(m.TotalOutput) / s
		m.TotalTokenThroughput = float64(m.TotalInput+m.TotalOutput) / s
		if slo.Set() {
			g := float64(m.GoodRequests) / s
			m.Goodput = &g
		}
	} else if slo.Set() {
		g := 0.0
		m.Goodput = &g
	}
	m.TTFT, m.TPOT, m.ITL, m.E2EL = Summarize(ttft), Summarize(tpot), Summarize(itl), Summarize(e2el)
	m.KVBytes, m.KVTransferMs, m.KVShareTTFT = Summarize(kvBytes), Summarize(kvMs), Summarize(kvShare)
	computeReuse(&m, records)
	return m
}
