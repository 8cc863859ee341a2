package tcp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
)

// The test binary, run with peerEnv set, is the sending process of
// BenchmarkOpProcess: it prints the address it listens on, accepts two
// connections, control and data, and answers each control message of
// ctlLen bytes on the first:
//
//	'r': writes opBytes back on the control connection with one Write
//	     (the bare ping the tcp op is compared with);
//	'd': writes opBytes on the data connection with one Write;
//	't' n desc: Sends opBytes to the receipt of the n-byte descriptor desc
//	     over its tcp Transport.
//
// It exits when the control connection ends.
const (
	peerEnv = "KVXFER_TCP_BENCH_PEER"
	ctlLen  = 100
	opBytes = 64 << 10
)

// peerMain runs the peer process and returns its exit code.
func peerMain() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "peer:", err); return 1 }
	tr, err := Open(context.Background(), transport.Options{})
	if err != nil {
		return fail(err)
	}
	defer tr.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	fmt.Println(ln.Addr())
	c, err := ln.Accept()
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	d, err := ln.Accept()
	ln.Close()
	if err != nil {
		return fail(err)
	}
	defer d.Close()
	c.(*net.TCPConn).SetNoDelay(true)
	d.(*net.TCPConn).SetNoDelay(true)
	src := make([]byte, opBytes)
	for i := range src {
		src[i] = byte(i * 7)
	}
	var msg [ctlLen]byte
	for {
		if _, err := io.ReadFull(c, msg[:]); err != nil {
			return 0 // the parent is done
		}
		switch msg[0] {
		case 'r':
			_, err = c.Write(src)
		case 'd':
			_, err = d.Write(src)
		case 't':
			err = tr.Send(context.Background(), transport.Descriptor(msg[2:2+msg[1]]), [][]byte{src})
		default:
			err = fmt.Errorf("control message %q", msg[0])
		}
		if err != nil {
			return fail(err)
		}
	}
}

// BenchmarkOpProcess measures one small op between two processes, as a
// generation rank pulls one 64 KiB block: this process arms a receipt and
// writes its descriptor (a 100-byte control message, as a request-info) to
// a peer process, which Sends the block over tcp; the op ends when the
// receipt is done. "ping" is the floor it is compared with, the same round
// trip with no transport: 100 bytes over the control connection, answered
// with the 64 KiB on it, read with io.ReadFull. "ping-2conns-handoff"
// answers on a second connection, read by another goroutine that hands the
// block over with a channel, as tcp does (its data connection is not the
// control connection, and its reader is not the goroutine that waits for the
// receipt): the floor of that shape.
func BenchmarkOpProcess(b *testing.B) {
	cmd, addr, exited := startPeer(b, peerEnv)
	defer func() { <-exited }()
	var conns [2]net.Conn
	var err error
	for i := range conns {
		if conns[i], err = net.Dial("tcp", addr); err != nil {
			cmd.Process.Kill()
			b.Fatal(err)
		}
		defer conns[i].Close() // the peer exits
		conns[i].(*net.TCPConn).SetNoDelay(true)
	}
	c, data := conns[0], conns[1]
	rx, err := Open(context.Background(), transport.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer rx.Close()
	dst := make([]byte, opBytes)
	var msg [ctlLen]byte
	// reader reads the data connection for "handoff", as tcp's reader
	// goroutine does, and hands each block over with a channel.
	read := make(chan error)
	go func() {
		for {
			_, err := io.ReadFull(data, dst)
			if err != nil {
				close(read) // the data connection closed
				return
			}
			read <- nil
		}
	}()
	defer func() {
		data.Close()
		for range read {
		}
	}()

	ops := []struct {
		name string
		op   func() error
	}{
		{"ping", func() error {
			msg[0] = 'r'
			if _, err := c.Write(msg[:]); err != nil {
				return err
			}
			_, err := io.ReadFull(c, dst)
			return err
		}},
		{"ping-2conns-handoff", func() error {
			msg[0] = 'd'
			if _, err := c.Write(msg[:]); err != nil {
				return err
			}
			if _, ok := <-read; !ok {
				return errors.New("the data connection closed")
			}
			return nil
		}},
		{"tcp", func() error {
			r, err := rx.Expect([][]byte{dst})
			if err != nil {
				return err
			}
			d := r.Descriptor()
			msg[0], msg[1] = 't', byte(len(d))
			copy(msg[2:], d)
			if _, err := c.Write(msg[:]); err != nil {
				return err
			}
			select {
			case <-r.Done():
				return r.Err()
			case <-exited:
				r.Cancel()
				return errors.New("the peer exited")
			}
		}},
	}
	for _, o := range ops {
		b.Run(o.name, func(b *testing.B) {
			for range 100 { // untimed: dial, fault the pages in, grow the windows
				if err := o.op(); err != nil {
					b.Fatal(err)
				}
			}
			b.SetBytes(opBytes)
			for b.Loop() {
				if err := o.op(); err != nil {
					b.Fatal(err)
				}
			}
			for i := range dst {
				if dst[i] != byte(i*7) {
					b.Fatalf("byte %d is %d, want %d", i, dst[i], byte(i*7))
				}
			}
		})
	}
}

// startPeer starts this test binary as the peer process that env selects,
// and returns it with the address it prints first. exited is closed when
// the peer has ended: it ends an op whose peer has died (it says why on
// stderr), so that a timed loop needs no timer of its own; the caller
// waits for it before returning.
func startPeer(b *testing.B, env string) (cmd *exec.Cmd, addr string, exited <-chan struct{}) {
	cmd = exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env+"=1")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		b.Fatalf("peer: %v", err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	return cmd, strings.TrimSpace(line), done
}
