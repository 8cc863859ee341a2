package serve

import (
	"strings"
	"testing"
)

func TestDisaggregatedParamsValidate(t *testing.T) {
	id := uint64(3)
	for _, tc := range []struct {
		p    DisaggregatedParams
		want string
	}{
		{DisaggregatedParams{RequestType: TypeContextOnly}, ""},
		{DisaggregatedParams{RequestType: TypeContextAndGeneration}, ""},
		{DisaggregatedParams{RequestType: TypeGenerationOnly, CtxRequestID: &id, EncodedOpaqueState: "x", FirstGenTokens: []int32{1}}, ""},
		{DisaggregatedParams{}, "request_type is required"},
		{DisaggregatedParams{RequestType: "prefill"}, `"prefill" is not one of`},
		{DisaggregatedParams{RequestType: TypeGenerationOnly, CtxRequestID: &id, FirstGenTokens: []int32{1}}, "encoded_opaque_state is required"},
		{DisaggregatedParams{RequestType: TypeGenerationOnly, EncodedOpaqueState: "x", FirstGenTokens: []int32{1}}, "ctx_request_id is required"},
		{DisaggregatedParams{RequestType: TypeGenerationOnly, CtxRequestID: &id, EncodedOpaqueState: "x"}, "first_gen_tokens is required"},
		{DisaggregatedParams{RequestType: TypeGenerationOnly, CtxRequestID: &id, EncodedOpaqueState: "x", FirstGenTokens: []int32{1, 2}}, "one beam"},
	} {
		err := tc.p.validate()
		if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want %q", tc.p, err, tc.want)
		}
	}
}
