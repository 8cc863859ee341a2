package engine

import (
	"iter"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/transceiver"
)

// Request is one generation request as the HTTP layer hands it over.
type Request struct {
	// Type is context_and_generation (the default), context_only or
	// generation_only (disaggregated_params.request_type).
	Type transceiver.RequestType
	// Prompt holds the prompt's token ids, BOS first (Tokenizer.Encode); for
	// generation_only, the prompt_token_ids the context instance returned.
	Prompt []int32
	// MaxTokens is the most tokens to generate, counting the first token a
	// context instance generated; 0 means Options.DefaultMaxTokens.
	MaxTokens int
	Sampling  Sampling
	// Stop strings end the generation when the text produces one; the text
	// returned excludes it.
	Stop []string
	// StopTokenIDs end the generation when generated (like EOS).
	StopTokenIDs []int32
	// IgnoreEOS keeps generating after EOS.
	IgnoreEOS bool
	// CacheSalt keeps the request's cached prefixes apart from those of
	// requests with another salt (vLLM's cache_salt): it is folded into the
	// root of the chained block hashes (kvcache.RootHash). Empty shares the
	// prefixes of every unsalted request.
	CacheSalt string
	// ContextPhase is required for generation_only: the context instance's
	// ctx_request_id, first_gen_tokens (one: beam width 1) and opaque state.
	ContextPhase *transceiver.ContextPhaseParams
	// Resume continues a request after these tokens, which it generated
	// and delivered before (on an instance that died: the router migrates
	// the request). The KV cache is the prompt's and theirs; the k-th token
	// generated from here is the request's (len(Resume)+k)-th, sampled with
	// PCG(seed, len(Resume)+k) exactly as the uninterrupted request would;
	// MaxTokens, the stop strings and the stop tokens count them; the text
	// emitted is what the uninterrupted request emits after them (text it
	// held back at their end comes first). Usage counts them as completion
	// tokens, and PromptTokenIDs is the prompt alone. For context_only, the
	// first token sampled is the (len(Resume))-th; for generation_only,
	// the context instance's KV cache covers the prompt and Resume. Resume
	// must be shorter than MaxTokens, and must not have ended the request
	// (EOS, a stop token or a stop string).
	Resume []int32
}

// Finish reasons, as in OpenAI responses plus TensorRT-LLM's
// "not_finished" (a context_only request whose generation continues
// elsewhere).
const (
	FinishLength      = "length"
	FinishStop        = "stop"
	FinishError       = "error"
	FinishNotFinished = "not_finished"
)

// NoToken is the Token of an event that carries no token (the final one).
const NoToken int32 = -1

// Event is one item of a request's stream: a generated token with the text
// it completes, or, last, the final event.
type Event struct {
	// Token is the generated token, or NoToken in the final event.
	Token int32
	// Text is the text that can be sent now. It may be empty: the token is
	// a special token, ends inside a UTF-8 sequence, or may be the start of
	// a stop string. The final event carries the rest. The concatenation of
	// every Text is the completion's text.
	Text string
	// Final is set on the last event only.
	Final *Final
}

// Final is the end of a request.
type Final struct {
	// FinishReason is FinishLength, FinishStop, FinishError or
	// FinishNotFinished.
	FinishReason string
	// Err says why, when FinishReason is FinishError: a transfer error
	// (wrapping ErrTransfer and the transceiver's error), the client's
	// context error, ErrClosed, ...
	Err error
	// State is the request's last state.
	State  transceiver.RequestState
	Usage  Usage
	Timing Timing
	// PromptTokenIDs is the prompt (for a context_only response, which the
	// router forwards to the generation instance).
	PromptTokenIDs []int32
	// ContextPhase is set for a context_only request handed to the
	// transceiver: ctx_request_id, first_gen_tokens and the opaque state.
	ContextPhase *transceiver.ContextPhaseParams
}

// Usage counts tokens as OpenAI responses do.
type Usage struct {
	PromptTokens     int
	CompletionTokens int
	// CachedTokens are the prompt tokens whose KV the engine found in its
	// own reusable cache (neither computed nor received); OpenAI's
	// usage.prompt_tokens_details.cached_tokens.
	CachedTokens int
}

// Timing splits a request's time.
type Timing struct {
	Queue         time.Duration // Submit to admission (blocks allocated)
	Prefill       time.Duration // the prompt's forward pass and the first token
	KVTransfer    time.Duration // generation_only: start of the pull to its completion
	TransferBytes int64         // generation_only: KV bytes received
	// TransferBlocks (generation_only) is how many of the prompt's blocks
	// the instance asked the context instance for: all of them, less the
	// prefix it found in its own cache; BlockBytes is the size of one
	// block summed over the instance's ranks. Together they say what a
	// transfer should have moved.
	TransferBlocks int
	BlockBytes     int64
	FirstDecode    time.Duration // the first decode step
	Decode         time.Duration // every decode step
	Total          time.Duration // Submit to the final event
}

// Stream is the output of one request: its events, in order, the last one
// with Final set. Read it with Events, from one goroutine at a time. The
// engine never blocks on a slow reader: the stream keeps the events
// produced and not yet read, so its memory follows what the request has
// generated and its reader not yet taken, not what it may generate (a
// channel sized for max_tokens took 512 KiB per request at max_tokens
// 16000, queued or not). A reader that stops early should cancel the
// request's context.
type Stream struct {
	id uint64

	mu    sync.Mutex
	buf   []Event // produced, not yet read
	ended bool    // the final event is in buf or was read
	// wake holds a token once an event arrives after the reader last
	// looked; the reader waits on it when buf is empty.
	wake chan struct{}
}

func newStream() *Stream { return &Stream{wake: make(chan struct{}, 1)} }

// push appends ev, the last event if ev.Final is set, and wakes the reader.
// Only the engine's goroutine calls it.
func (s *Stream) push(ev Event) {
	s.mu.Lock()
	s.buf = append(s.buf, ev)
	s.ended = ev.Final != nil
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// ID returns the request's id in this engine; for a context_only request it
// is the ctx_request_id.
func (s *Stream) ID() uint64 { return s.id }

// Events yields the stream's events as they come, waiting for each, and
// ends after the final one. A loop that breaks early leaves the events it
// did not take for the next Events loop over the same stream.
func (s *Stream) Events() iter.Seq[Event] {
	return func(yield func(Event) bool) {
		var batch []Event
		for {
			s.mu.Lock()
			clear(batch) // no strings or Finals kept from the last batch
			batch, s.buf = s.buf, batch[:0]
			ended := s.ended
			s.mu.Unlock()
			for i, ev := range batch {
				if !yield(ev) {
					s.unread(batch[i+1:])
					return
				}
			}
			if ended {
				return
			}
			if len(batch) == 0 {
				<-s.wake
			}
		}
	}
}

// unread puts back, ahead of what arrived since, the events a loop that
// broke early did not take.
func (s *Stream) unread(evs []Event) {
	if len(evs) == 0 {
		return
	}
	s.mu.Lock()
	s.buf = append(slices.Clone(evs), s.buf...)
	s.mu.Unlock()
}

// Result is a whole stream, collected.
type Result struct {
	Tokens []int32
	Text   string
	Final  Final
}

// Wait reads the stream to its end and returns it collected.
func (s *Stream) Wait() Result {
	var res Result
	var b strings.Builder
	for ev := range s.Events() {
		b.WriteString(ev.Text)
		if ev.Final != nil {
			res.Final = *ev.Final
			continue
		}
		res.Tokens = append(res.Tokens, ev.Token)
	}
	res.Text = b.String()
	return res
}
