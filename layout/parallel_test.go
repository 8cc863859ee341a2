package layout

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestRankCoordsRoundTrip(t *testing.T) {
	for _, p := range []ParallelConfig{
		{TP: 1, PP: 1, CP: 1}, {TP: 2, PP: 2, CP: 1}, {TP: 3, PP: 4, CP: 1}, {TP: 4, PP: 2, CP: 3}, {TP: 8, PP: 1, CP: 1},
	} {
		if got, want := p.NumRanks(), p.TP*p.PP*p.CP; got != want {
			t.Errorf("%v: NumRanks = %d, want %d", p, got, want)
		}
		for r := range p.NumRanks() {
			pp, cp, tp := p.Coords(r)
			if pp < 0 || pp >= p.PP || cp < 0 || cp >= p.CP || tp < 0 || tp >= p.TP {
				t.Fatalf("%v: Coords(%d) = (%d,%d,%d) out of range", p, r, pp, cp, tp)
			}
			if want := pp*p.TP*p.CP + cp*p.TP + tp; want != r {
				t.Fatalf("%v: Coords(%d) = (%d,%d,%d), which numbers rank %d", p, r, pp, cp, tp, want)
			}
			if got := p.Rank(pp, cp, tp); got != r {
				t.Fatalf("%v: Rank(Coords(%d)) = %d", p, r, got)
			}
		}
	}
}

func TestDPGroup(t *testing.T) {
	p := ParallelConfig{TP: 8, PP: 1, CP: 1, AttentionDP: true, DPSize: 4}
	if got := p.TPPerDP(); got != 2 {
		t.Fatalf("TPPerDP = %d, want 2", got)
	}
	for tp, want := range [][2]int{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}, {2, 1}, {3, 0}, {3, 1}} {
		g, l := p.DPGroup(tp)
		if g != want[0] || l != want[1] {
			t.Errorf("DPGroup(%d) = (%d,%d), want (%d,%d)", tp, g, l, want[0], want[1])
		}
	}
	if got := (ParallelConfig{TP: 4, PP: 1, CP: 1}).TPPerDP(); got != 4 {
		t.Errorf("TPPerDP without attention DP = %d, want 4", got)
	}
}

func TestLayerRanges(t *testing.T) {
	tests := []struct {
		name   string
		p      ParallelConfig
		layers int
		want   [][2]int
	}{
		{"even", ParallelConfig{TP: 1, PP: 2, CP: 1}, 16, [][2]int{{0, 8}, {8, 16}}},
		{"remainder to first stages", ParallelConfig{TP: 1, PP: 4, CP: 1}, 10, [][2]int{{0, 3}, {3, 6}, {6, 8}, {8, 10}}},
		{"one stage", ParallelConfig{TP: 2, PP: 1, CP: 1}, 7, [][2]int{{0, 7}}},
		{"one layer per stage", ParallelConfig{TP: 1, PP: 3, CP: 1}, 3, [][2]int{{0, 1}, {1, 2}, {2, 3}}},
		{"uneven", ParallelConfig{TP: 1, PP: 3, CP: 1, LayersPerPP: []int{5, 1, 4}}, 10, [][2]int{{0, 5}, {5, 6}, {6, 10}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got [][2]int
			var counts []int
			for pp := range tt.p.PP {
				lo, hi := tt.p.LayerRange(tt.layers, pp)
				got = append(got, [2]int{lo, hi})
				counts = append(counts, hi-lo)
			}
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("LayerRange (-want +got):\n%s", d)
			}
			if d := cmp.Diff(counts, tt.p.StageLayerCounts(tt.layers)); d != "" {
				t.Errorf("StageLayerCounts disagrees with LayerRange (-ranges +counts):\n%s", d)
			}
		})
	}
}
