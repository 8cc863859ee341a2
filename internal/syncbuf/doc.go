// Package syncbuf has a bytes.Buffer that goroutines can share: the sink
// that tests give a logger (or several goroutines write to) and read back.
//
// It owns only that; it is meant for tests and keeps nothing else.
package syncbuf
