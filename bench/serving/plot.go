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
// throughput, one line per target (disaggregated, aggregated).
func (r *Report) WritePNG(w io.Writer) error {
	ttft, tput := r.newPlot("TTFT (ms): p50 solid, p99 dashed"), r.newPlot("output throughput (tokens/s)")
	xlabel := "request rate asked (requests/s)"
	if r.achievedX() {
		xlabel = "request throughput reached (requests/s)"
	}
	ttft.X.Label.Text, tput.X.Label.Text = xlabel, xlabel
	var ymaxT, ymaxP float64
	for i, t := range r.Config.Targets {
		var p50, p99, out plotter.XYs
		for _, run := range r.Runs {
			if run.Target != t || run.Completed == 0 {
				continue
			}
			x := r.xOf(run)
			p50 = append(p50, plotter.XY{X: x, Y: run.TTFT.P50})
			p99 = append(p99, plotter.XY{X: x, Y: run.TTFT.P99})
			out = append(out, plotter.XY{X: x, Y: run.OutputThroughput})
			ymaxT = max(ymaxT, run.TTFT.P99)
			ymaxP = max(ymaxP, run.OutputThroughput)
		}
		if len(p50) == 0 {
			continue
		}
		for _, xy := range []plotter.XYs{p50, p99, out} {
			slices.SortFunc(xy, func(a, b plotter.XY) int { return int(math.Copysign(1, a.X-b.X)) })
		}
		c, glyph := bench.SeriesStyle(i)
		for _, s := range []struct {
			p      *plot.Plot
			xy     plotter.XYs
			dashed bool
			legend bool
		}{{ttft, p50, false, true}, {ttft, p99, true, false}, {tput, out, false, true}} {
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
			if s.legend {
				s.p.Legend.Add(t.Name, line, points)
			}
		}
	}
	for _, a := range []struct {
		p    *plot.Plot
		ymax float64
	}{{ttft, ymaxT}, {tput, ymaxP}} {
		a.p.Y.Min, a.p.Y.Max = 0, max(a.ymax, 1)*1.1
		a.p.Y.Tick.Marker = plot.TickerFunc(bench.LinearTicks)
		a.p.X.Tick.Marker = plot.TickerFunc(bench.LinearTicks)
		if a.ymax == 0 {
			a.p.Title.Text += " (no completed run)"
		}
	}
	img := vgimg.NewWith(vgimg.UseWH(plotWidth, plotHeight), vgimg.UseDPI(plotDPI), vgimg.UseBackgroundColor(color.White))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Points(20), PadY: vg.Points(10), PadTop: vg.Points(10), PadBottom: vg.Points(10),
		PadLeft: vg.Points(10), PadRight: vg.Points(10)}
	for i, c := range plot.Align([][]*plot.Plot{{ttft, tput}}, tiles, dc)[0] {
		[]*plot.Plot{ttft, tput}[i].Draw(c)
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
