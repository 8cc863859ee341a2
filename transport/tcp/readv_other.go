//go:build !linux

package tcp

import "net"

// sysReader would read with readv; it is Linux-only, and vecReader falls
// back to Read elsewhere.
type sysReader struct{}

func newSysReader(net.Conn, int) *sysReader { return nil }

func (*sysReader) resetLowat() {}

func (*sysReader) readv([][]byte) (int, error) { panic("tcp: readv is Linux-only") }
