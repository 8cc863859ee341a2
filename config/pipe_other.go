//go:build !unix

package config

import (
	"io"
	"os"
	"time"
)

// readPipe reads the named pipe at path, at most limit bytes. Only unix
// systems bound the wait for a writer (pipe_unix.go).
func readPipe(path string, limit int64, _ time.Duration) ([]byte, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	return io.ReadAll(io.LimitReader(fh, limit))
}
