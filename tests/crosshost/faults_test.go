package crosshost

import (
	"os/exec"
	"time"
)

// faults runs the TCP backend with every transceiver connection between
// the generation worker's namespace and the context worker's through the
// fault proxy, both ways.
//
// Where the proxy sits: the opaque state carries the context worker's
// transceiver endpoints, and the context side dials the generation side's
// data endpoints, so a proxy on the router→worker HTTP path would see
// none of the KV bytes. Instead each worker's transceiver listens on an
// address of its own (P for the context worker, Q for the generation
// worker: /32s of another prefix, on the worker's eth0, routed by hand
// from the test's namespace) and the peer's namespace holds that same
// address on its lo, so the peer's connections to it end in the peer's
// namespace, on listeners the proxy opens there (same ports); the proxy
// dials the real address from the test's namespace, over the bridge.
// Every control and data connection of every transfer, either way, goes
// through it; nothing in the workers knows.
func (cl *cluster) faults(next int) {
	t := cl.t
	P, Q := cl.lab.alias+"3", cl.lab.alias+"4"
	cl.c.ip("addr", "add", P+"/32", "dev", "eth0")
	cl.g.ip("addr", "add", Q+"/32", "dev", "eth0")
	run(t, "ip", "route", "add", P+"/32", "via", cl.c.addr)
	t.Cleanup(func() { exec.Command("ip", "route", "delete", P+"/32").Run() })
	run(t, "ip", "route", "add", Q+"/32", "via", cl.g.addr)
	t.Cleanup(func() { exec.Command("ip", "route", "delete", Q+"/32").Run() })
	cl.g.ip("addr", "add", P+"/32", "dev", "lo")
	cl.c.ip("addr", "add", Q+"/32", "dev", "lo")

	// Through the proxy each side sees the other's connections come from
	// the test's namespace (the bridge's address) and sends its data to the
	// peer's alias, neither of them the peer's own address: an operator
	// with such a proxy lists both, or the context worker refuses to send
	// a generation peer's data to an address the peer merely named.
	cl.peerHosts = []string{cl.lab.prefix + "0/24", cl.lab.alias + "0/24"}
	defer func() { cl.peerHosts = nil }()
	w := cl.startWorkers("TCP", P, Q)
	px := newProxy()
	t.Cleanup(px.close)
	for _, side := range []struct {
		p     *proc
		http  string
		tx    string
		other *host
	}{{w.ctx, cl.c.addr, P, cl.g}, {w.gen, cl.g.addr, Q, cl.c}} {
		ports := txListeners(t, side.p, side.tx, side.http, side.tx)
		if len(ports) == 0 {
			t.Fatalf("%s: no listener on %s", side.p.name, side.tx)
		}
		for _, ap := range ports {
			ln, err := side.other.listen(ap.String())
			if err != nil {
				t.Fatalf("proxy listener for %v in %s: %v", ap, side.other.name, err)
			}
			px.serve(ln, ap.String())
		}
		t.Logf("fault proxy: %s's transceiver listeners %v, reached from %s through the proxy", side.p.name, ports, side.other.name)
	}

	type phase struct {
		name  string
		f     faults
		n     int
		exact bool // every request must complete bit-exact
	}
	phases := []phase{
		{"no fault (through the proxy)", faults{}, 8, true},
		{"latency 20 ms each way", faults{Latency: 20 * time.Millisecond}, 8, true},
		{"bandwidth 1 MiB/s each way per connection", faults{Rate: 1 << 20}, 8, true},
		// 4 transfers of ~300 KB at once share a data connection: close to
		// the 5 s kv_transfer_timeout_ms, so a timeout (a clear error) is allowed.
		{"bandwidth 256 KiB/s each way per connection", faults{Rate: 256 << 10}, 8, false},
		{"latency 20 ms + 1 MiB/s", faults{Latency: 20 * time.Millisecond, Rate: 1 << 20}, 8, true},
		{"reset of every open connection after 1–64 KiB", faults{ResetOpen: true}, 8, false},
		{"resets: 30% of the connections, new ones too, after 1–64 KiB", faults{ResetP: 0.3}, 12, false},
		{"stall (nothing forwarded, connections kept open)", faults{Stall: true}, 4, false},
	}
	for _, ph := range phases {
		px.set(ph.f)
		b0, c0, r0 := px.bytes.Load(), px.accepted.Load(), px.resets.Load()
		start := time.Now()
		tl := burst(t, cl.client, cl.router, next, ph.n, 4, reqDeadline, cl.want)
		next += ph.n
		took := time.Since(start)
		px.set(faults{})
		t.Logf("fault %s: %s in %v (proxy: %d bytes, %d new connections, %d resets)", ph.name, tl, took.Round(time.Millisecond),
			px.bytes.Load()-b0, px.accepted.Load()-c0, px.resets.Load()-r0)
		for _, e := range tl.errs {
			t.Logf("  %s", e)
		}
		if tl.n[bad] > 0 {
			t.Errorf("fault %s: %d requests neither bit-exact nor a clear error", ph.name, tl.n[bad])
		}
		if ph.exact && tl.n[okExact] != ph.n {
			t.Errorf("fault %s: %d of %d bit-exact, want all", ph.name, tl.n[okExact], ph.n)
		}
		if ph.name == phases[0].name && px.bytes.Load() == 0 {
			t.Fatal("no byte went through the fault proxy: the transfers took another path")
		}
		// Healed: the next requests complete, and no block stays pinned.
		rt := burst(t, cl.client, cl.router, next, 4, 4, reqDeadline, cl.want)
		next += 4
		if rt.n[okExact] != 4 {
			t.Errorf("after fault %s healed: %s: %v", ph.name, rt, rt.errs)
		}
		noPinned(t, cl.client, w.ctx.name, w.ctx.url)
		noPinned(t, cl.client, w.gen.name, w.gen.url)
	}
	cl.stopWorkers(w)
}
