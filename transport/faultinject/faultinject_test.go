package faultinject_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/faultinject"
	"github.com/kvxfer/kvxfer/transport/tcp"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func openTCP(t *testing.T) transport.Transport {
	t.Helper()
	tr, err := tcp.Open(context.Background(), transport.Options{}.WithDefaults())
	if err != nil {
		t.Fatalf("tcp.Open: %v", err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

func pair(t *testing.T, plan string) (a, b *faultinject.Transport) {
	t.Helper()
	p, err := faultinject.ParsePlan(plan)
	if err != nil {
		t.Fatal(err)
	}
	return faultinject.Wrap(openTCP(t), p), faultinject.Wrap(openTCP(t), p)
}

// The wrapper without faults is a conforming backend.
func TestConformanceNoFaults(t *testing.T) {
	transporttest.RunOptions(t, func(t *testing.T) (a, b transport.Transport) {
		x, y := pair(t, "seed=1")
		return x, y
	}, transporttest.Options{SkipLarge: true}) // tcp's own suite runs 256 MiB
}

// The wrapper with only delays and reordering is still a conforming
// backend: those faults change timing, never results.
func TestConformanceDelayReorder(t *testing.T) {
	transporttest.RunOptions(t, func(t *testing.T) (a, b transport.Transport) {
		x, y := pair(t, "seed=3;send:delay/3=2ms;send:reorder/4=5ms;expect:delay/5=1ms;expect:reorder/7=2ms")
		return x, y
	}, transporttest.Options{SkipLarge: true}) // faults per operation, not per byte
}

func payload(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + 1)
	}
	return b
}

func waitDone(t *testing.T, r transport.Recv) error {
	t.Helper()
	select {
	case <-r.Done():
		return r.Err()
	case <-time.After(10 * time.Second):
		t.Fatal("receipt did not end within 10s")
		return nil
	}
}

// transfer sends n bytes from a to b and returns the Send error, the
// receipt's error (nil when it had not ended 200 ms after a failed Send;
// it is then cancelled) and whether dst equals what was sent.
func transfer(t *testing.T, a, b transport.Transport, n int) (sendErr, recvErr error, equal bool) {
	t.Helper()
	src := payload(n)
	dst := make([]byte, n)
	r, err := b.Expect([][]byte{dst})
	if err != nil {
		return nil, err, false
	}
	sendErr = a.Send(context.Background(), r.Descriptor(), [][]byte{src})
	if sendErr != nil {
		select {
		case <-r.Done():
			recvErr = r.Err()
		case <-time.After(200 * time.Millisecond):
			r.Cancel()
		}
		return sendErr, recvErr, false
	}
	recvErr = waitDone(t, r)
	return nil, recvErr, bytes.Equal(src, dst)
}

func TestFailEveryNth(t *testing.T) {
	a, b := pair(t, "seed=0;send:fail/3")
	fails := 0
	for i := range 9 {
		sendErr, recvErr, equal := transfer(t, a, b, 1000)
		switch {
		case sendErr != nil:
			fails++
			if !errors.Is(sendErr, transport.ErrPeerLost) {
				t.Errorf("send %d: %v, want ErrPeerLost", i, sendErr)
			}
			var fe *faultinject.Error
			if !errors.As(sendErr, &fe) || fe.Kind != faultinject.Fail {
				t.Errorf("send %d: %v is not an injected failure", i, sendErr)
			}
		case recvErr != nil || !equal:
			t.Errorf("transfer %d: recv %v, equal %v", i, recvErr, equal)
		}
	}
	if fails != 3 || a.Injected(faultinject.OpSend, faultinject.Fail) != 3 {
		t.Errorf("%d failures (%d counted), want 3 of 9", fails, a.Injected(faultinject.OpSend, faultinject.Fail))
	}
}

func TestExpectFail(t *testing.T) {
	_, b := pair(t, "seed=0;expect:fail/1")
	if _, err := b.Expect([][]byte{make([]byte, 10)}); !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("Expect: %v, want ErrPeerLost", err)
	}
}

func TestDelay(t *testing.T) {
	a, b := pair(t, "send:delay/1=60ms")
	start := time.Now()
	sendErr, recvErr, equal := transfer(t, a, b, 4096)
	if d := time.Since(start); d < 60*time.Millisecond {
		t.Errorf("delayed transfer took %v, want >= 60ms", d)
	}
	if sendErr != nil || recvErr != nil || !equal {
		t.Fatalf("delayed transfer: send %v recv %v equal %v", sendErr, recvErr, equal)
	}
	// A delayed Send gives up when its context ends.
	r, err := b.Expect([][]byte{make([]byte, 10)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Cancel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	if err := a.Send(ctx, r.Descriptor(), [][]byte{payload(10)}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Send past its deadline: %v", err)
	}
}

// A truncated Send never completes a receipt: the backend refuses it.
func TestTruncateSend(t *testing.T) {
	a, b := pair(t, "send:truncate/1")
	for _, n := range []int{1, 2, 5000, 1 << 20} {
		sendErr, recvErr, _ := transfer(t, a, b, n)
		if sendErr == nil {
			t.Fatalf("%d bytes: truncated send succeeded", n)
		}
		if recvErr == nil {
			continue // still waiting: cancelled by transfer
		}
		t.Logf("%d bytes: send %v; receipt %v", n, sendErr, recvErr)
	}
}

// A truncated receipt fails and its tail is gone.
func TestTruncateExpect(t *testing.T) {
	a, b := pair(t, "expect:truncate/2")
	results := []bool{}
	for range 4 {
		sendErr, recvErr, equal := transfer(t, a, b, 10000)
		if sendErr != nil {
			t.Fatalf("send: %v", sendErr)
		}
		if recvErr != nil {
			if !errors.Is(recvErr, transport.ErrPeerLost) || equal {
				t.Errorf("truncated receipt: %v, equal %v", recvErr, equal)
			}
		} else if !equal {
			t.Error("receipt completed with other bytes")
		}
		results = append(results, recvErr == nil)
	}
	ok := 0
	for _, r := range results {
		if r {
			ok++
		}
	}
	if ok != 2 {
		t.Errorf("results %v: want 2 of 4 complete", results)
	}
	// Cancel of a receipt, truncated or not (one of two is), gives dst
	// back.
	for range 2 {
		r, err := b.Expect([][]byte{make([]byte, 10)})
		if err != nil {
			t.Fatal(err)
		}
		r.Cancel()
		if err := waitDone(t, r); !errors.Is(err, transport.ErrCanceled) {
			t.Fatalf("cancelled: %v", err)
		}
	}
}

// A held-back Send completes after a later one.
func TestReorder(t *testing.T) {
	a, b := pair(t, "seed=0;send:reorder/2=2s")
	// The plan holds the first of the two sends (it does the same every
	// run); the second must go while the first is held.
	p, _ := faultinject.ParsePlan("seed=0;send:reorder/2=2s")
	if _, hit := p.Hit(faultinject.OpSend, 1); !hit {
		t.Fatal("the plan does not hold the first send: the test's premise changed")
	}
	var order []int
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 1; i <= 2; i++ {
		dst := make([]byte, 100)
		r, err := b.Expect([][]byte{dst})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if i == 2 {
				// The first goes first: the second waits until the first
				// is numbered (and so held), then a moment for it to reach
				// its hold. A sleep alone let a first goroutine descheduled
				// for longer (a loaded machine) be numbered second.
				for deadline := time.Now().Add(10 * time.Second); a.Injected(faultinject.OpSend, faultinject.Reorder) == 0; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Error("the first send not numbered within 10 s")
						return
					}
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err := a.Send(context.Background(), r.Descriptor(), [][]byte{payload(100)}); err != nil {
				t.Error(err)
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			if err := waitDone(t, r); err != nil {
				t.Error(err)
			}
		}()
	}
	began := time.Now()
	close(start)
	wg.Wait()
	if len(order) != 2 || order[0] != 2 {
		t.Errorf("completion order %v, want the held first send last", order)
	}
	if time.Since(began) > time.Second {
		t.Errorf("held send waited %v: it should go when the later one completes", time.Since(began))
	}
}

func TestPlanDeterministic(t *testing.T) {
	p, err := faultinject.ParsePlan("seed=42;send:fail/7;expect:truncate/5;send:delay/3=20ms")
	if err != nil {
		t.Fatal(err)
	}
	q, err := faultinject.ParsePlan(p.String())
	if err != nil || q.String() != p.String() {
		t.Fatalf("round trip %q -> %q, %v", p, q, err)
	}
	hits := 0
	for n := uint64(1); n <= 70; n++ {
		r1, h1 := p.Hit(faultinject.OpSend, n)
		r2, h2 := q.Hit(faultinject.OpSend, n)
		if h1 != h2 || r1 != r2 {
			t.Fatalf("op %d: plans differ", n)
		}
		if h1 && r1.Kind == faultinject.Fail {
			hits++
		}
	}
	if hits != 10 {
		t.Errorf("send:fail/7 hit %d of 70 sends, want 10", hits)
	}
	for _, bad := range []string{"send", "send:fail", "send:fail/0", "recv:fail/1", "send:melt/2", "send:delay/2=x", "seed=-1"} {
		if _, err := faultinject.ParsePlan(bad); err == nil {
			t.Errorf("ParsePlan(%q) accepted", bad)
		}
	}
}

func TestFromEnv(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	if w, err := faultinject.FromEnv(getenv); w != nil || err != nil {
		t.Fatalf("unset: %v, %v; want no wrapper", w != nil, err)
	}
	env[faultinject.EnvPlan] = "seed=1;send:fail/1"
	w, err := faultinject.FromEnv(getenv)
	if err != nil || w == nil {
		t.Fatalf("FromEnv: %v", err)
	}
	tr := w("tcp", openTCP(t))
	if tr.Name() != "faulty+tcp" {
		t.Errorf("transport name %q", tr.Name())
	}
	r, err := tr.Expect([][]byte{make([]byte, 8)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Cancel()
	if err := tr.Send(context.Background(), r.Descriptor(), [][]byte{payload(8)}); !errors.Is(err, transport.ErrPeerLost) {
		t.Errorf("Send with send:fail/1: %v", err)
	}
	env[faultinject.EnvPlan] = "send:nope/1"
	if _, err := faultinject.FromEnv(getenv); err == nil || !strings.Contains(err.Error(), faultinject.EnvPlan) {
		t.Errorf("FromEnv with a bad plan: %v, want an error naming %s", err, faultinject.EnvPlan)
	}
}
