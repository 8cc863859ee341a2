package serve

import (
	"github.com/kvxfer/kvxfer/metrics"
	"github.com/kvxfer/kvxfer/transceiver"
)

// Transceiver returns the worker's transceiver; nil when it has none (an
// aggregated worker without cache_transceiver_config).
func (w *Worker) Transceiver() *transceiver.Transceiver { return w.tr }

// Metrics returns the worker's metrics (registered on Registry), for the
// listeners its caller runs (HTTP connections).
func (w *Worker) Metrics() *metrics.Set { return w.m }

// The transceiver's control connections, counted by the worker's observer.
func (o observer) ControlConnOpened() { o.m.Conns.Listener(metrics.ListenerControl).Opened() }
func (o observer) ControlConnClosed() { o.m.Conns.Listener(metrics.ListenerControl).Closed() }
func (o observer) ControlConnRefused(reason string) {
	o.m.Conns.Listener(metrics.ListenerControl).Refused(reason)
}
func (o observer) ControlConnIdleClosed() { o.m.Conns.Listener(metrics.ListenerControl).IdleClosed() }

var _ transceiver.ConnObserver = observer{}
