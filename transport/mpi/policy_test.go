package mpi

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

func TestFrameBytesFor(t *testing.T) {
	tests := []struct {
		opt, want int
	}{
		{transport.DefaultFrameBytes, FrameBytes},
		{1 << 20, 1 << 20},
		{64 << 10, 64 << 10},
		{32 << 20, 32 << 20},
		{transport.MaxFrameBytes, transport.MaxFrameBytes},
	}
	for _, tt := range tests {
		if got := frameBytesFor(tt.opt); got != tt.want {
			t.Errorf("frameBytesFor(%d) = %d, want %d", tt.opt, got, tt.want)
		}
	}
	if FrameBytes > transport.MaxFrameBytes || FrameBytes <= transport.DefaultFrameBytes {
		t.Errorf("FrameBytes = %d, want above the generic default %d and at most %d", FrameBytes, transport.DefaultFrameBytes, transport.MaxFrameBytes)
	}
}

func TestWaitNapFor(t *testing.T) {
	tests := []struct {
		name         string
		recvs, sends int
		awaitingCTS  bool
		want         time.Duration
	}{
		{"idle after work", 0, 0, false, 0},
		{"a send waits for its cts", 0, 0, true, 0},
		{"receiving", 3, 0, false, 0},
		{"receiving and sending", 3, 4, false, 0},
		{"sending only", 0, 4, false, sendNap},
		{"sending, another send waits for its cts", 0, 4, true, 0},
		{"one frame in flight", 0, 1, false, sendNap},
	}
	for _, tt := range tests {
		if got := waitNapFor(tt.recvs, tt.sends, tt.awaitingCTS); got != tt.want {
			t.Errorf("%s: waitNapFor(%d, %d, %v) = %v, want %v", tt.name, tt.recvs, tt.sends, tt.awaitingCTS, got, tt.want)
		}
	}
	// Exhaustively: never a nap while anything is received, and a nap
	// exactly when sends are the only data in flight and no cts is awaited.
	for r := range 3 {
		for s := range 3 {
			for _, a := range []bool{false, true} {
				got := waitNapFor(r, s, a)
				want := r == 0 && s > 0 && !a
				if (got > 0) != want {
					t.Errorf("waitNapFor(%d, %d, %v) = %v, want a nap: %v", r, s, a, got, want)
				}
			}
		}
	}
}
