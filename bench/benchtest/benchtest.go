package benchtest

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/santhosh-tekuri/jsonschema/v6"
)

// schemaID names the report's schema inside the compiler.
const schemaID = "https://github.com/kvxfer/kvxfer/bench/report.schema.json"

// Schema compiles the report's JSON Schema; a schema that does not compile
// fails the test.
func Schema(t testing.TB) *jsonschema.Schema {
	t.Helper()
	return CompileSchema(t, schemaID, bench.ReportSchema())
}

// CompileSchema compiles the JSON Schema text under id (bench serve's
// report has its own); a schema that does not compile fails the test.
func CompileSchema(t testing.TB, id, text string) *jsonschema.Schema {
	t.Helper()
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	if err := c.AddResource(id, doc); err != nil {
		t.Fatal(err)
	}
	sch, err := c.Compile(id)
	if err != nil {
		t.Fatalf("the schema does not compile: %v", err)
	}
	return sch
}

// Validate checks a JSON report against sch.
func Validate(sch *jsonschema.Schema, data []byte) error {
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		return err
	}
	return sch.Validate(v)
}

// ReadReport reads the JSON report at path, checks it against the schema
// and decodes it; a report that cannot be read, does not validate or does
// not decode fails the test.
func ReadReport(t testing.TB, path string) *bench.Report {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := Validate(Schema(t), data); err != nil {
		t.Fatalf("the report does not validate: %v", err)
	}
	var rep bench.Report
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatal(err)
	}
	return &rep
}
