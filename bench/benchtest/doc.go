// Package benchtest checks bench reports in tests: the JSON Schema of the
// report (bench.ReportSchema) compiled by santhosh-tekuri/jsonschema, a
// complete draft 2020-12 implementation that also checks the schema itself
// against the meta-schema, which a validator of our own would not.
//
// It is for tests only: bench's own and those of the command that writes
// the report (internal/cli).
package benchtest
