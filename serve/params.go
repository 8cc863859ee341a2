package serve

import (
	"encoding/json"
	"fmt"
)

// DisaggregatedParams are TensorRT-LLM's disaggregated_params of an
// OpenAI-compatible request or response choice.
type DisaggregatedParams struct {
	// RequestType is context_only, generation_only or
	// context_and_generation.
	RequestType string `json:"request_type"`
	// FirstGenTokens holds the first generated token, one per beam.
	FirstGenTokens []int32 `json:"first_gen_tokens,omitempty"`
	// CtxRequestID is the context server's request id.
	CtxRequestID *uint64 `json:"ctx_request_id,omitempty"`
	// EncodedOpaqueState is the base64 opaque state (context CacheState,
	// CommState, transfer token).
	EncodedOpaqueState string `json:"encoded_opaque_state,omitempty"`
	// DraftTokens are speculative tokens. Accepted and passed on with the
	// context phase, but not used: kvxfer has no speculative decoding (a
	// worker logs that once, the first time a request carries some).
	DraftTokens []int32 `json:"draft_tokens"`
}

// Request types of disaggregated_params.
const (
	TypeContextOnly          = "context_only"
	TypeGenerationOnly       = "generation_only"
	TypeContextAndGeneration = "context_and_generation"
)

// validate checks the fields a worker needs for the request type.
func (d *DisaggregatedParams) validate() error {
	switch d.RequestType {
	case TypeContextOnly, TypeContextAndGeneration:
		return nil
	case TypeGenerationOnly:
		switch {
		case d.EncodedOpaqueState == "":
			return fmt.Errorf("disaggregated_params.encoded_opaque_state is required for generation_only")
		case d.CtxRequestID == nil:
			return fmt.Errorf("disaggregated_params.ctx_request_id is required for generation_only")
		case len(d.FirstGenTokens) == 0:
			return fmt.Errorf("disaggregated_params.first_gen_tokens is required for generation_only (one token per beam)")
		case len(d.FirstGenTokens) > 1:
			return fmt.Errorf("disaggregated_params.first_gen_tokens has %d entries; kvxfer serves one beam", len(d.FirstGenTokens))
		}
		return nil
	case "":
		return fmt.Errorf("disaggregated_params.request_type is required (context_only, generation_only or context_and_generation)")
	}
	return fmt.Errorf("disaggregated_params.request_type %q is not one of context_only, generation_only, context_and_generation", d.RequestType)
}

// object is a JSON object whose fields we read and rewrite without losing
// the ones we do not know.
type object map[string]json.RawMessage

func (o object) set(key string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // programmer error: only marshalable values are set
	}
	o[key] = b
}

func (o object) get(key string, v any) (bool, error) {
	raw, ok := o[key]
	if !ok || string(raw) == "null" {
		return false, nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return true, fmt.Errorf("field %q: %v", key, err)
	}
	return true, nil
}
