//go:build !linux

package tcp

import "net"

// sysReader would read with readv; it is Linux-only, and vecReader falls
// back to Read elsewhere.
type sysReader struct{}

func newSysReader(net.Conn) *sysReader { return nil }

func (*sysReader) readv([][]byte) (int, error) { panic("tcp: readv is Linux-only") }
