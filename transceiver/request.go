package transceiver

import (
	"fmt"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
)

// RequestType says which phases a request runs where (TensorRT-LLM's
// request types).
type RequestType uint8

// Request types.
const (
	ContextAndGeneration RequestType = iota
	ContextOnly
	GenerationOnly
)

func (t RequestType) String() string {
	switch t {
	case ContextAndGeneration:
		return "context_and_generation"
	case ContextOnly:
		return "context_only"
	case GenerationOnly:
		return "generation_only"
	}
	return fmt.Sprintf("request_type(%d)", uint8(t))
}

// ParseRequestType parses the names used in disaggregated_params.
func ParseRequestType(s string) (RequestType, error) {
	for _, t := range []RequestType{ContextAndGeneration, ContextOnly, GenerationOnly} {
		if t.String() == s {
			return t, nil
		}
	}
	return 0, fmt.Errorf("transceiver: unknown request_type %q (valid: context_only, generation_only, context_and_generation)", s)
}

// RequestState is the state of a request, with TensorRT-LLM's names.
type RequestState uint8

// Request states, in the order a request goes through them. Any transfer
// failure ends in DisaggTransError.
const (
	ContextInit RequestState = iota
	DisaggContextTransInProgress
	DisaggContextComplete
	DisaggGenerationInit
	DisaggGenerationTransInProgress
	DisaggGenerationTransComplete
	GenerationInProgress
	GenerationComplete
	DisaggTransError
)

var stateNames = [...]string{
	"CONTEXT_INIT", "DISAGG_CONTEXT_TRANS_IN_PROGRESS", "DISAGG_CONTEXT_COMPLETE",
	"DISAGG_GENERATION_INIT", "DISAGG_GENERATION_TRANS_IN_PROGRESS", "DISAGG_GENERATION_TRANS_COMPLETE",
	"GENERATION_IN_PROGRESS", "GENERATION_COMPLETE", "DISAGG_TRANS_ERROR",
}

func (s RequestState) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("request_state(%d)", uint8(s))
}

// ContextPhaseParams is what the context instance hands back for a
// context_only request and what the generation instance needs to pull it
// (disaggregated_params over HTTP).
type ContextPhaseParams struct {
	CtxRequestID   uint64
	FirstGenTokens []int32
	DraftTokens    []int32
	// OpaqueState is the encoded OpaqueState (binary; base64 over HTTP).
	OpaqueState []byte
}

// Stats are the figures of one finished transfer, over all the ranks of the
// instance.
type Stats struct {
	Bytes    int64         // bytes this instance sent or received
	Duration time.Duration // from the first rank's start to the last rank's end
	Backend  string        // the backend that carried the data ("tcp"; "" when nothing moved)
	Chunks   int           // staging chunks moved (1 per peer pair for a direct transfer)
	// Agreement is the time from the end of the last rank's part to the
	// request's completion here: what the instance's consensus cost (with
	// ranks in several processes, the trip through the Group's log; near
	// 0 with every rank in one process). Ranks on other hosts report their
	// end on their clock.
	Agreement time.Duration
}

// GBps returns Bytes/Duration in 1e9 bytes per second.
func (s Stats) GBps() float64 {
	if s.Duration <= 0 {
		return 0
	}
	return float64(s.Bytes) / s.Duration.Seconds() / 1e9
}

// Request is one request as the transceiver sees it. The caller fills ID,
// Type, DPRank, Blocks (and ContextPhase on the generation side) before
// handing it over; the transceiver changes only its state, error, stats and
// (on the context side) ContextPhase.
type Request struct {
	// ID identifies the request in its instance; on the context side it
	// becomes the ctx_request_id. IDs of requests in flight must differ.
	ID   uint64
	Type RequestType
	// DPRank is the attention-DP group holding the request (0 without
	// attention DP).
	DPRank int
	// Blocks[r] are rank r's blocks of the request, in order, pinned by the
	// caller. Ranks outside the request's DP group have none.
	Blocks [][]kvcache.BlockID
	// NumTokens is the number of tokens the blocks hold (the prompt). On
	// the context side it travels in the opaque state; on the generation
	// side, when set, it must equal the context request's, so that a prompt
	// that does not match its KV cache is refused instead of decoded
	// wrongly. 0 means unknown (not checked).
	NumTokens int
	// BlockHashes are the reuse hashes of the request's full blocks, in
	// order (optional; needed only to serve "last N blocks ending at hash").
	BlockHashes []kvcache.Hash
	// PromptDigest is the digest of the prompt whose KV the blocks hold
	// (kvcache.PromptDigest), or zero for none. On the context side a
	// request with a digest refuses every pull whose request has another
	// (or none), so that KV computed for one prompt is never received as
	// another of the same length: a generation instance that publishes the
	// blocks it received for reuse would otherwise serve them to other
	// requests under the wrong prompt's hashes. The generation side sends
	// its own.
	PromptDigest kvcache.Hash
	// LastBlockHash, on the generation side, asks for the last len(Blocks[r])
	// blocks ending at the block with this hash (the generation side holds
	// a reused prefix). Nil asks for all the request's blocks.
	LastBlockHash *kvcache.Hash
	// ContextPhase is set by RespondAndSendAsync and read by
	// RequestAndReceiveAsync.
	ContextPhase *ContextPhaseParams

	mu    sync.Mutex
	state RequestState
	err   error
	stats Stats
	done  chan struct{} // closed when the transfer ends; nil before it starts
}

// State returns the request's state.
func (r *Request) State() RequestState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state
}

// Err returns why the transfer failed (state DisaggTransError), or nil.
func (r *Request) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// Stats returns the transfer figures once the transfer has ended.
func (r *Request) Stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stats
}

// SetState sets the state; the executor uses it for the states the
// transceiver does not own (GENERATION_IN_PROGRESS, ...).
func (r *Request) SetState(s RequestState) {
	r.mu.Lock()
	r.state = s
	r.mu.Unlock()
}
