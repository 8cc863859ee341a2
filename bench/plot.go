package bench

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Colours a reader with a colour-vision deficiency can tell apart (Okabe &
// Ito, Tol): runs get the saturated ones, baselines the others.
var (
	seriesColors   = []color.Color{rgb(0x0072B2), rgb(0xD55E00), rgb(0x009E73), rgb(0x882255), rgb(0x44AA99), rgb(0x332288)}
	baselineColors = map[string]color.Color{
		BaselineCopy: rgb(0x000000), BaselineRawTCP: rgb(0xE69F00), BaselineIperf3: rgb(0x56B4E9), BaselineUCXPerftest: rgb(0xCC79A7),
		BaselineOpenSSL: rgb(0x999933), BaselineUCXC: rgb(0x661100),
	}
	seriesGlyphs = []draw.GlyphDrawer{draw.CircleGlyph{}, draw.BoxGlyph{}, draw.PyramidGlyph{}, draw.RingGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}}
)

func rgb(v uint32) color.Color {
	return color.RGBA{R: uint8(v >> 16), G: uint8(v >> 8), B: uint8(v), A: 0xff}
}

// The chart's size: 10 × 5.5 inches at 144 dots per inch.
const (
	plotWidth  = 10 * vg.Inch
	plotHeight = 5.5 * vg.Inch
	plotDPI    = 144
)

// series is one line of the chart: the successful runs that differ only in
// ISL.
type series struct {
	name string
	xy   plotter.XYs
}

// chartSeries groups the runs by backend (and by dtype and concurrency
// where the sweep has several), in the order of the report.
func (r *Report) chartSeries() []series {
	multiD, multiC := len(r.Config.DTypes) > 1, len(r.Config.Concurrency) > 1
	var out []series
	used := map[string][]string{}
	for _, run := range r.Runs {
		name := run.BackendLabel()
		if multiD {
			name += " " + run.DType
		}
		if multiC {
			name += fmt.Sprintf(" c=%d", run.Concurrency)
		}
		i := slices.IndexFunc(out, func(s series) bool { return s.name == name })
		if i < 0 {
			out = append(out, series{name: name})
			i = len(out) - 1
		}
		if run.GBps > 0 {
			out[i].xy = append(out[i].xy, plotter.XY{X: float64(run.ISL), Y: run.GBps})
			if !slices.Contains(used[name], run.Backend) {
				used[name] = append(used[name], run.Backend)
			}
		}
	}
	for i, s := range out {
		// "auto (shm)": say what carried the data when it was not what
		// was asked for.
		if u := used[s.name]; len(u) == 1 && !strings.HasPrefix(s.name, strings.TrimSuffix(u[0], "(tls)")) {
			out[i].name += " (" + u[0] + ")"
		}
		slices.SortFunc(out[i].xy, func(a, b plotter.XY) int { return int(a.X - b.X) })
	}
	return out
}

// WritePNG draws the chart of the report as a PNG image: GB/s against the
// prompt length (ISL, log2 axis), one line per backend, the measured
// baselines as horizontal dashed lines, the legend to the right.
func (r *Report) WritePNG(w io.Writer) error {
	p := r.newPlot()
	leg := newChartLegend()
	ymax, err := r.plotSeries(p, leg)
	if err != nil {
		return err
	}
	yb, err := r.plotBaselines(p, leg)
	if err != nil {
		return err
	}
	ymax = max(ymax, yb)
	if ymax == 0 {
		ymax = 1
		p.Title.Text += " (no successful run)"
	}
	p.Y.Min, p.Y.Max = 0, ymax*1.1
	p.Y.Tick.Marker = plot.TickerFunc(linearTicks)

	img := vgimg.NewWith(vgimg.UseWH(plotWidth, plotHeight), vgimg.UseDPI(plotDPI), vgimg.UseBackgroundColor(color.White))
	dc := draw.New(img)
	legW := vg.Length(0)
	for _, e := range leg.texts {
		legW = max(legW, leg.TextStyle.Rectangle(" "+e).Max.X)
	}
	legW += leg.ThumbnailWidth + 24
	pad := vg.Points(10)
	p.Draw(draw.Crop(dc, pad, -legW, pad, -pad))
	leg.Draw(draw.Crop(dc, plotWidth-legW+pad, -pad, pad, -3*pad))
	_, err = vgimg.PngCanvas{Canvas: img}.WriteTo(w)
	return err
}

// newPlot is the chart without its lines: title, axes (ISL on a log2
// scale over the sweep's ISLs) and grid.
func (r *Report) newPlot() *plot.Plot {
	p := plot.New()
	title := fmt.Sprintf("kvxfer bench: %s, context TP%d PP%d → generation TP%d PP%d", r.Config.Model,
		r.Config.Ctx.TP, r.Config.Ctx.PP, r.Config.Gen.TP, r.Config.Gen.PP)
	if len(r.Config.DTypes) == 1 {
		title += ", " + r.Config.DTypes[0]
	}
	p.Title.Text = title
	p.Title.TextStyle.Font = font.From(plot.DefaultFont, 15)
	p.Title.Padding = 10
	p.X.Label.Text = "prompt length (ISL, tokens)"
	p.Y.Label.Text = "GB/s (1e9 bytes per second)"
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font = font.From(plot.DefaultFont, 13)
		a.Tick.Label.Font = font.From(plot.DefaultFont, 11)
		a.Label.Padding = 6
	}

	isls := slices.Clone(r.Config.ISLs)
	if len(isls) == 0 {
		isls = []int{1024}
	}
	lo, hi := float64(slices.Min(isls)), float64(slices.Max(isls))
	p.X.Min, p.X.Max = lo/math.Sqrt2, hi*math.Sqrt2
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.TickerFunc(pow2Ticks)

	grid := plotter.NewGrid()
	grid.Vertical.Color = color.Gray{Y: 0xdd}
	grid.Horizontal.Color = color.Gray{Y: 0xdd}
	p.Add(grid)
	return p
}

// chartLegend is the chart's legend with the texts of its entries, which
// size its column.
type chartLegend struct {
	plot.Legend
	texts []string
}

func newChartLegend() *chartLegend {
	leg := &chartLegend{Legend: plot.NewLegend()}
	leg.TextStyle.Font = font.From(plot.DefaultFont, 12)
	leg.ThumbnailWidth = 34
	leg.Left, leg.Top = true, true
	leg.Padding = 4
	return leg
}

func (l *chartLegend) add(text string, thumbs ...plot.Thumbnailer) {
	l.Add(text, thumbs...)
	l.texts = append(l.texts, text)
}

// plotSeries adds a line per series of runs and returns the highest GB/s.
func (r *Report) plotSeries(p *plot.Plot, leg *chartLegend) (float64, error) {
	ymax := 0.0
	for i, s := range r.chartSeries() {
		if len(s.xy) == 0 {
			leg.add("kvxfer " + s.name + ": no successful run")
			continue
		}
		line, points, err := plotter.NewLinePoints(s.xy)
		if err != nil {
			return 0, err
		}
		c := seriesColors[i%len(seriesColors)]
		line.Color, line.Width = c, vg.Points(2.5)
		points.GlyphStyle = draw.GlyphStyle{Color: c, Radius: vg.Points(4), Shape: seriesGlyphs[i%len(seriesGlyphs)]}
		p.Add(line, points)
		leg.add("kvxfer "+s.name, line, points)
		for _, xy := range s.xy {
			ymax = max(ymax, xy.Y)
		}
	}
	return ymax, nil
}

// plotBaselines adds a dashed line per measured baseline across the x range
// and returns the highest GB/s.
func (r *Report) plotBaselines(p *plot.Plot, leg *chartLegend) (float64, error) {
	ymax := 0.0
	for _, b := range r.Baselines {
		if b.GBps <= 0 {
			continue
		}
		line, err := plotter.NewLine(plotter.XYs{{X: p.X.Min, Y: b.GBps}, {X: p.X.Max, Y: b.GBps}})
		if err != nil {
			return 0, err
		}
		line.Color, line.Width = baselineColors[b.Name], vg.Points(1.8)
		if line.Color == nil {
			line.Color = color.Gray{Y: 0x66}
		}
		line.Dashes = []vg.Length{vg.Points(7), vg.Points(4)}
		p.Add(line)
		leg.add(fmt.Sprintf("%s %.2f GB/s (%s)", b.Name, b.GBps, strings.Join(b.Backends, ", ")), line)
		ymax = max(ymax, b.GBps)
	}
	return ymax, nil
}

// pow2Ticks marks every power of two in [lo, hi], labelled "512", "1K",
// "16K" (every other one when there are many).
func pow2Ticks(lo, hi float64) []plot.Tick {
	var ticks []plot.Tick
	first := math.Exp2(math.Ceil(math.Log2(lo)))
	n := int(math.Floor(math.Log2(hi)-math.Log2(first))) + 1
	for i := range n {
		v := first * math.Exp2(float64(i))
		t := plot.Tick{Value: v}
		if n <= 12 || i%2 == 0 {
			t.Label = tokens(int64(v))
		}
		ticks = append(ticks, t)
	}
	return ticks
}

// linearTicks labels 4 to 8 round values (steps of 1, 2 or 5 × 10^k) in
// [lo, hi], with a minor tick between each.
func linearTicks(lo, hi float64) []plot.Tick {
	if hi <= lo {
		return []plot.Tick{{Value: lo, Label: strconv.FormatFloat(lo, 'g', 3, 64)}}
	}
	// The smallest step that leaves at most 7 intervals.
	mag := math.Pow(10, math.Floor(math.Log10((hi-lo)/7)))
	step := 10 * mag
	for _, m := range []float64{1, 2, 5} {
		if (hi-lo)/(m*mag) <= 7 {
			step = m * mag
			break
		}
	}
	decimals := max(0, int(-math.Floor(math.Log10(step))))
	var ticks []plot.Tick
	for k := math.Ceil(lo / step); k*step <= hi*(1+1e-9); k++ {
		v := k * step
		ticks = append(ticks, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'f', decimals, 64)})
		if half := v + step/2; half <= hi {
			ticks = append(ticks, plot.Tick{Value: half})
		}
	}
	return ticks
}

// tokens formats a token count: 512, 1K, 16K, 1M.
func tokens(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprint(n)
}

// SeriesStyle returns the colour and glyph of the i-th line of a chart,
// as this package's charts draw them (for the serving benchmark's).
func SeriesStyle(i int) (color.Color, draw.GlyphDrawer) {
	return seriesColors[i%len(seriesColors)], seriesGlyphs[i%len(seriesGlyphs)]
}

// LinearTicks labels 4 to 8 round values in [lo, hi], as this package's
// charts do.
func LinearTicks(lo, hi float64) []plot.Tick { return linearTicks(lo, hi) }
