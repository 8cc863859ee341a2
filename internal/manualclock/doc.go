// Package manualclock is a clock that tests advance by hand, for code that
// takes its time from an injected Now and AfterFunc (the transceiver's
// deadlines, the control plane's handshake and idle timeouts): deadlines
// pass when the test says so, not after a real sleep. It is test support;
// nothing in a production path uses it.
package manualclock
