package serving

import (
	"image/color"
	"io"
	"math"
	"slices"

	"github.com/kvxfer/kvxfer/bench"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// The chart's size: 12 × 5 inches at 144 dots per inch.
const (
	plotWidth  = 12 * vg.Inch
	plotHeight = 5 * vg.Inch
	plotDPI    = 144
)

// xOf is a run's place on the charts' x axis: the rate asked for, or the
// request throughput reached when a run had no rate (all at once).
func (r *Report) xOf(run *Result) float64 {
	if r.achievedX() {
		return run.RequestThroughput
	}
	return run.Rate
}

func (r *Report) achievedX() bool {
	return slices.ContainsFunc(r.Config.Rates, func(v float64) bool { return v <= 0 || math.IsInf(v, 1) })
}

// WritePNG draws the report as a PNG image of two charts against the
// request rate: TTFT p50 (solid) and p99 (dashed), and output-token
// throughput, one line per target (disaggregated, aggregated). A report
// of conversations of several turns has a second row against the turn
// index, a line per run: the KV moved per request (mean, solid) and the
// bytes of its new blocks (dashed), and the prefix-hit rate; at a single
// rate, TTFT by turn takes the place of the charts against the rate.
func (r *Report) WritePNG(w io.Writer) error {
	ttft, tput, err := r.rateCharts()
	if err != nil {
		return err
	}
	rows := [][]*plot.Plot{{ttft, tput}}
	width := plotWidth
	if r.perTurnRuns() > 0 {
		kv, hit, byTurn, err := r.turnPlots()
		if err != nil {
			return err
		}
		if len(r.Config.Rates) == 1 {
			// One rate: the charts against it would be a dot per run;
			// against the turn they say more.
			rows, width = [][]*plot.Plot{{byTurn, kv, hit}}, plotWidth*3/2
		} else {
			rows = append(rows, []*plot.Plot{kv, hit})
		}
	}
	return writeTiles(w, rows, width)
}

// rateCharts are the charts against the request rate: TTFT p50 and p99,
// and output-token throughput, a line per target.
func (r *Report) rateCharts() (ttft, tput *plot.Plot, err error) {
	ttft, tput = r.newPlot("TTFT (ms): p50 solid, p99 dashed"), r.newPlot("output throughput (tokens/s)")
	xlabel := "request rate asked (requests/s)"
	if r.achievedX() {
		xlabel = "request throughput reached (requests/s)"
	}
	ttft.X.Label.Text, tput.X.Label.Text = xlabel, xlabel
	var ymaxT, ymaxP float64
	for i, t := range r.Config.Targets {
		p50, p99, out := r.targetSeries(t)
		for k := range p99 {
			ymaxT, ymaxP = max(ymaxT, p99[k].Y), max(ymaxP, out[k].Y)
		}
		if len(p50) == 0 {
			continue
		}
		if err := addTargetLines(ttft, tput, i, t, p50, p99, out); err != nil {
			return nil, nil, err
		}
	}
	scaleAxes(ttft, ymaxT)
	scaleAxes(tput, ymaxP)
	return ttft, tput, nil
}

// targetSeries are target t's points against the request rate, of its
// runs that completed a request: TTFT p50 and p99 and output throughput,
// in the order of x.
func (r *Report) targetSeries(t Target) (p50, p99, out plotter.XYs) {
	for _, run := range r.Runs {
		if run.Target != t || run.Completed == 0 {
			continue
		}
		x := r.xOf(run)
		p50 = append(p50, plotter.XY{X: x, Y: run.TTFT.P50})
		p99 = append(p99, plotter.XY{X: x, Y: run.TTFT.P99})
		out = append(out, plotter.XY{X: x, Y: run.OutputThroughput})
	}
	for _, xy := range []plotter.XYs{p50, p99, out} {
		slices.SortFunc(xy, func(a, b plotter.XY) int { return int(math.Copysign(1, a.X-b.X)) })
	}
	return p50, p99, out
}

// addTargetLines adds the lines of target t, the i-th, to the charts:
// TTFT p50 (solid, in the legend) and p99 (dashed) to ttft, output
// throughput to tput.
func addTargetLines(ttft, tput *plot.Plot, i int, t Target, p50, p99, out plotter.XYs) error {
	c, glyph := bench.SeriesStyle(i)
	name := t.Short()
	for _, s := range []series{{ttft, p50, false, name}, {ttft, p99, true, ""}, {tput, out, false, name}} {
		if err := addSeries(s, c, glyph); err != nil {
			return err
		}
	}
	return nil
}

// series is one line of a chart: its points on p, dashed or solid, and
// its name in p's legend ("": not in it).
type series struct {
	p      *plot.Plot
	xy     plotter.XYs
	dashed bool
	legend string
}

// addSeries adds s to its chart as a line with points in colour c and
// glyph.
func addSeries(s series, c color.Color, glyph draw.GlyphDrawer) error {
	line, points, err := plotter.NewLinePoints(s.xy)
	if err != nil {
		return err
	}
	line.Color, line.Width = c, vg.Points(2.5)
	if s.dashed {
		line.Dashes = []vg.Length{vg.Points(7), vg.Points(4)}
	}
	points.GlyphStyle = draw.GlyphStyle{Color: c, Radius: vg.Points(4), Shape: glyph}
	s.p.Add(line, points)
	if s.legend != "" {
		s.p.Legend.Add(s.legend, line, points)
	}
	return nil
}

// scaleAxes sets chart p's axes: y from 0 to a tenth above ymax, linear
// ticks; a chart with nothing drawn (ymax 0) says so in its title.
func scaleAxes(p *plot.Plot, ymax float64) {
	p.Y.Min, p.Y.Max = 0, max(ymax, 1)*1.1
	p.Y.Tick.Marker = plot.TickerFunc(bench.LinearTicks)
	p.X.Tick.Marker = plot.TickerFunc(bench.LinearTicks)
	if ymax == 0 {
		p.Title.Text += " (no completed run)"
	}
}

// writeTiles writes the charts rows, aligned in tiles, to w as a PNG
// image width wide.
func writeTiles(w io.Writer, rows [][]*plot.Plot, width vg.Length) error {
	img := vgimg.NewWith(vgimg.UseWH(width, plotHeight*vg.Length(len(rows))), vgimg.UseDPI(plotDPI), vgimg.UseBackgroundColor(color.White))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: len(rows), Cols: len(rows[0]), PadX: vg.Points(20), PadY: vg.Points(20), PadTop: vg.Points(10), PadBottom: vg.Points(10),
		PadLeft: vg.Points(10), PadRight: vg.Points(10)}
	for i, row := range plot.Align(rows, tiles, dc) {
		for j, c := range row {
			rows[i][j].Draw(c)
		}
	}
	_, err := vgimg.PngCanvas{Canvas: img}.WriteTo(w)
	return err
}

// newPlot is a chart without its lines: title, axes, grid and legend.
func (r *Report) newPlot(title string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.Title.TextStyle.Font = font.From(plot.DefaultFont, 14)
	p.Title.Padding = 8
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font = font.From(plot.DefaultFont, 12)
		a.Tick.Label.Font = font.From(plot.DefaultFont, 10)
		a.Label.Padding = 6
	}
	p.Legend.TextStyle.Font = font.From(plot.DefaultFont, 12)
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.ThumbnailWidth = 34
	grid := plotter.NewGrid()
	grid.Vertical.Color = color.Gray{Y: 0xdd}
	grid.Horizontal.Color = color.Gray{Y: 0xdd}
	p.Add(grid)
	return p
}

// perTurnRuns counts the runs with figures for more than one turn.
func (r *Report) perTurnRuns() int {
	n := 0
	for _, run := range r.Runs {
		if len(run.PerTurn) > 1 {
			n++
		}
	}
	return n
}

// turnPlots draws the per-turn charts against the turn index, a line per
// run: KV moved per request (mean, solid) and new blocks' bytes (dashed)
// in MiB, the prefix-hit rate in %, and TTFT p50 (solid) and p99
// (dashed).
func (r *Report) turnPlots() (kv, hit, ttft *plot.Plot, err error) {
	kv = r.newPlot("KV per request (MiB, mean): moved solid, new blocks dashed")
	hit = r.newPlot("prefix-hit rate (%)")
	ttft = r.newPlot("TTFT by turn (ms): p50 solid, p99 dashed")
	kv.X.Label.Text, hit.X.Label.Text, ttft.X.Label.Text = "turn", "turn", "turn"
	var ymaxK, ymaxT float64
	hits := 0
	for i, run := range r.Runs {
		var moved, fresh, rate, p50, p99 plotter.XYs
		for _, t := range run.PerTurn {
			x := float64(t.Turn)
			if t.TTFT.N > 0 {
				p50 = append(p50, plotter.XY{X: x, Y: t.TTFT.P50})
				p99 = append(p99, plotter.XY{X: x, Y: t.TTFT.P99})
				ymaxT = max(ymaxT, t.TTFT.P99)
			}
			if t.KVBytes.N > 0 {
				moved = append(moved, plotter.XY{X: x, Y: t.KVBytes.Mean / (1 << 20)})
				ymaxK = max(ymaxK, t.KVBytes.Mean/(1<<20))
			}
			if t.NewBytes.N > 0 {
				fresh = append(fresh, plotter.XY{X: x, Y: t.NewBytes.Mean / (1 << 20)})
				ymaxK = max(ymaxK, t.NewBytes.Mean/(1<<20))
			}
			if t.PrefixHitRate != nil {
				rate = append(rate, plotter.XY{X: x, Y: 100 * *t.PrefixHitRate})
			}
		}
		c, glyph := bench.SeriesStyle(i)
		name, freshName := run.Label(), ""
		if len(moved) == 0 {
			freshName = name
		}
		for _, s := range []series{{kv, moved, false, name}, {kv, fresh, true, freshName}, {hit, rate, false, name}, {ttft, p50, false, name}, {ttft, p99, true, ""}} {
			if len(s.xy) == 0 {
				continue
			}
			if err := addSeries(s, c, glyph); err != nil {
				return nil, nil, nil, err
			}
		}
		hits += len(rate)
	}
	kv.Y.Min, kv.Y.Max = 0, max(ymaxK, 0.01)*1.1
	ttft.Y.Min, ttft.Y.Max = 0, max(ymaxT, 1)*1.1
	hit.Y.Min, hit.Y.Max = 0, 105
	if hits == 0 {
		hit.Title.Text += " (no server reported cached_tokens)"
	}
	maxTurn := 1.0
	for _, run := range r.Runs {
		for _, t := range run.PerTurn {
			maxTurn = max(maxTurn, float64(t.Turn))
		}
	}
	for _, p := range []*plot.Plot{kv, hit, ttft} {
		p.X.Min, p.X.Max = 0, maxTurn
		p.X.Tick.Marker = plot.TickerFunc(bench.LinearTicks)
		p.Y.Tick.Marker = plot.TickerFunc(bench.LinearTicks)
	}
	return kv, hit, ttft, nil
}
