package serving

import _ "embed"

//go:embed report.schema.json
var reportSchema string

// ReportSchema returns the JSON Schema (draft 2020-12) of the report that
// Report.WriteJSON writes (`kvxfer bench serve --print-schema`).
func ReportSchema() string { return reportSchema }
