// Command perfreport is the last step of make bench-report: it reads the
// reports of kvxfer bench and the layout benchmarks' output, checks them
// against the speed targets and writes the summary into the README between
// its bench-report markers (package bench/perfreport). It measures nothing.
//
//	perfreport -readme README.md -main docs/perf.json -tp2 docs/perf-tp2.json \
//	    -ucx-tcp docs/perf-ucx-tcp.json -small docs/perf-small.json \
//	    -layout docs/perf-layout.txt -layout-command 'go test ...'
//
// It exits 0 when the summary was written, whether or not the targets were
// met (the summary says which were not), and 1 on a missing or bad input.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/kvxfer/kvxfer/bench/perfreport"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "perfreport:", err)
		os.Exit(1)
	}
}

func run() error {
	readme := flag.String("readme", "README.md", "the README to write the summary into")
	mainPath := flag.String("main", "", "report: identical layouts, llama-3.1-8b 4096 tokens")
	tp2 := flag.String("tp2", "", "report: context TP2 → generation TP1")
	ucxTCP := flag.String("ucx-tcp", "", "report: ucx with UCX_TLS=tcp")
	small := flag.String("small", "", "report: tiny model, one block, concurrency 1 and 8")
	layoutPath := flag.String("layout", "", "go test -bench output of the layout benchmarks")
	layoutCmd := flag.String("layout-command", "", "the command that produced -layout")
	flag.Parse()

	var ins perfreport.Inputs
	for _, r := range []struct {
		path string
		dst  **perfreport.Report
		flag string
	}{{*mainPath, &ins.Main, "-main"}, {*tp2, &ins.TP2, "-tp2"}, {*ucxTCP, &ins.UCXTCP, "-ucx-tcp"}, {*small, &ins.Small, "-small"}} {
		if r.path == "" {
			return fmt.Errorf("%s: a report is required", r.flag)
		}
		rep, err := perfreport.ReadReport(r.path)
		if err != nil {
			return fmt.Errorf("%s: %w", r.flag, err)
		}
		*r.dst = rep
	}
	f, err := os.Open(*layoutPath)
	if err != nil {
		return fmt.Errorf("-layout: %w", err)
	}
	defer f.Close()
	if ins.Layout, err = perfreport.ReadLayout(f); err != nil {
		return fmt.Errorf("-layout %s: %w", *layoutPath, err)
	}
	ins.LayoutCommand = *layoutCmd

	results := perfreport.Evaluate(ins)
	old, err := os.ReadFile(*readme)
	if err != nil {
		return err
	}
	out, err := perfreport.Splice(old, perfreport.Render(ins, results))
	if err != nil {
		return err
	}
	if err := os.WriteFile(*readme, out, 0o644); err != nil {
		return err
	}
	for _, r := range results {
		state := "met"
		if !r.Met {
			state = "NOT MET"
		}
		fmt.Printf("%-8s %s: %s\n", state, r.Target, r.Measured)
	}
	return nil
}
