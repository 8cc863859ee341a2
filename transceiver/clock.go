package transceiver

import "time"

// clock is where the driver gets time: the cores never read it; the driver
// passes Now in their events and arms their deadlines with AfterFunc.
// Tests inject a clock they advance by hand (Options.clock), so that
// deadlines pass without anyone sleeping through them.
type clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has passed. stop
	// cancels the call and reports whether it did (false: f has run or is
	// running).
	AfterFunc(d time.Duration, f func()) (stop func() bool)
}

// realClock is the clock of the machine.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) func() bool {
	return time.AfterFunc(d, f).Stop
}
