package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// value returns the sample of family name whose labels are exactly want.
func value(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(want) {
				continue
			}
			for _, l := range m.GetLabel() {
				if want[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			return m.GetGauge().GetValue() + m.GetCounter().GetValue(), true
		}
	}
	return 0, false
}

func TestConns(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := New(reg)
	ctl, web := s.Conns.Listener(ListenerControl), s.Conns.Listener(ListenerHTTP)
	ctl.Opened()
	ctl.Opened()
	ctl.Closed()
	ctl.Refused("max_conns_per_host")
	ctl.Refused("max_conns_per_host")
	ctl.IdleClosed()
	web.Opened()
	web.Refused("max_conns")
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvxfer_connections_open", map[string]string{"listener": "control"}, 1},
		{"kvxfer_connections_open", map[string]string{"listener": "http"}, 1},
		{"kvxfer_connections_refused_total", map[string]string{"listener": "control", "reason": "max_conns_per_host"}, 2},
		{"kvxfer_connections_refused_total", map[string]string{"listener": "http", "reason": "max_conns"}, 1},
		{"kvxfer_connections_idle_closed_total", map[string]string{"listener": "control"}, 1},
	} {
		got, ok := value(t, reg, tc.name, tc.labels)
		if !ok || got != tc.want {
			t.Errorf("%s%v = %v (present %v), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	// A router registers them alone, beside its own metrics.
	NewConns(prometheus.NewRegistry())
}
