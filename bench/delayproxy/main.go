// Command delayproxy is a TCP proxy that adds a fixed one-way delay in
// each direction, for benchmarks that model separate hosts on one
// machine: the kernel here has no netem. Every chunk read from one side
// is written to the other side no earlier than delay after it was read,
// in order, so a request and its reply each pay the delay once and a
// round trip pays it twice; throughput is not limited beyond that.
//
//	delayproxy -listen 127.0.0.1:9000 -to 127.0.0.1:7000 -delay 1ms
//	delayproxy -selftest -delay 1ms   # measures what it adds
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"time"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	to := flag.String("to", "", "address to forward to")
	delay := flag.Duration("delay", time.Millisecond, "one-way delay added in each direction")
	selftest := flag.Bool("selftest", false, "measure the round trip through the proxy against an echo server, and exit")
	flag.Parse()
	if *selftest {
		if err := selfTest(*delay); err != nil {
			log.Fatal(err)
		}
		return
	}
	if *to == "" {
		fmt.Fprintln(os.Stderr, "delayproxy: -to is required")
		os.Exit(2)
	}
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(l.Addr().String()) // the script reads where it listens
	serve(l, *to, *delay)
}

// serve accepts connections and proxies each to the target.
func serve(l net.Listener, to string, delay time.Duration) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			t, err := net.Dial("tcp", to)
			if err != nil {
				log.Printf("delayproxy: %v", err)
				return
			}
			defer t.Close()
			for _, cc := range []net.Conn{c, t} {
				if tc, ok := cc.(*net.TCPConn); ok {
					tc.SetNoDelay(true)
				}
			}
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); pipe(t, c, delay) }()
			go func() { defer wg.Done(); pipe(c, t, delay) }()
			wg.Wait()
		}()
	}
}

// chunk is bytes read at a time, to be written at due.
type chunk struct {
	b   []byte
	due time.Time
}

// pipe copies src to dst, each chunk delay after it was read.
func pipe(dst, src net.Conn, delay time.Duration) {
	q := make(chan chunk, 4096)
	go func() {
		defer close(q)
		for {
			b := make([]byte, 256<<10)
			n, err := src.Read(b)
			if n > 0 {
				q <- chunk{b[:n], time.Now().Add(delay)}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range q {
		waitUntil(c.due)
		if _, err := dst.Write(c.b); err != nil {
			break
		}
	}
	// Half-close so the other side sees EOF, then drain.
	if tc, ok := dst.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	for range q {
	}
}

// waitUntil returns at t. Sleeps on this machine overshoot by up to a
// millisecond or two, so the last stretch spins: a delay of 100 µs must
// not become 1 ms.
func waitUntil(t time.Time) {
	const spin = 2 * time.Millisecond
	if d := time.Until(t); d > spin {
		time.Sleep(d - spin)
	}
	for time.Now().Before(t) {
		runtime.Gosched()
	}
}

// selfTest runs an echo server behind the proxy and reports the median
// round trip of small messages directly and through it.
func selfTest(delay time.Duration) error {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go serve(pl, echo.Addr().String(), delay)
	rtt := func(addr string) (time.Duration, error) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return 0, err
		}
		defer c.Close()
		c.(*net.TCPConn).SetNoDelay(true)
		var ds []time.Duration
		b := make([]byte, 64)
		for range 200 {
			t0 := time.Now()
			if _, err := c.Write(b); err != nil {
				return 0, err
			}
			if _, err := io.ReadFull(c, b); err != nil {
				return 0, err
			}
			ds = append(ds, time.Since(t0))
		}
		slices.Sort(ds)
		return ds[len(ds)/2], nil
	}
	direct, err := rtt(echo.Addr().String())
	if err != nil {
		return err
	}
	proxied, err := rtt(pl.Addr().String())
	if err != nil {
		return err
	}
	fmt.Printf("one-way delay %v: round trip %v direct, %v through the proxy (adds %v; expected %v)\n",
		delay, direct, proxied, proxied-direct, 2*delay)
	return nil
}
