package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/nbd"
	"github.com/ovis-storage/ovis/qcow2"
)

// metrics are the Prometheus metrics of one served export: requests the
// device served by operation, with bytes, errors and latency; client
// connections; the qcow2 metadata caches; and the Go runtime and process.
// They live on a registry of their own, never the global one, so that two
// servers in one process (tests) do not collide.
type metrics struct {
	reg *prometheus.Registry

	requests *prometheus.CounterVec
	errors   *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	fua      prometheus.Counter
	conns    *prometheus.GaugeVec
	accepted prometheus.Counter
	// lookups counts the device's extent lookups: the server's own (one
	// per sparse read, several per BLOCK_STATUS request), apart from the
	// clients' BLOCK_STATUS requests that op="block_status" counts.
	lookups prometheus.Counter

	// ops holds each operation's children of the vectors, resolved once
	// so that a request does not hash its label.
	ops map[string]*opMetrics
	// states is each open connection's gauge label ("negotiating",
	// "transmission"); nbd reports one connection's states in order.
	states sync.Map
}

type opMetrics struct {
	requests, errors, bytes prometheus.Counter
	latency                 prometheus.Observer
}

// Operation labels of the request metrics.
const (
	opRead        = "read"
	opWrite       = "write"
	opWriteZeroes = "write_zeroes"
	opDiscard     = "discard"
	opFlush       = "flush"
	opBlockStatus = "block_status"
)

func newMetrics() *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ovis_block_requests_total", Help: "Requests the exported device served, by operation.",
	}, []string{"op"})
	m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ovis_block_request_errors_total", Help: "Requests that failed, by operation.",
	}, []string{"op"})
	m.bytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ovis_block_bytes_total", Help: "Bytes read, written, zeroed or discarded, or whose status was asked for, by operation.",
	}, []string{"op"})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "ovis_block_request_seconds", Help: "Time the device took per request, by operation.",
		// 10 µs (a cached 4 KiB read) to ~5 s (a flush behind a slow disk).
		Buckets: prometheus.ExponentialBuckets(10e-6, 4, 10),
	}, []string{"op"})
	m.fua = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ovis_block_fua_writes_total", Help: "Writes and zero writes with FUA (durable before the reply).",
	})
	m.conns = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "ovis_nbd_connections", Help: "Open client connections, by state (negotiating, transmission).",
	}, []string{"state"})
	m.accepted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ovis_nbd_connections_accepted_total", Help: "Client connections accepted.",
	})
	m.lookups = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ovis_block_extent_lookups_total",
		Help: "Allocation lookups on the device: a sparse read's hole map and the walk of each BLOCK_STATUS request.",
	})
	m.ops = map[string]*opMetrics{}
	for _, op := range []string{opRead, opWrite, opWriteZeroes, opDiscard, opFlush, opBlockStatus} {
		m.ops[op] = &opMetrics{
			requests: m.requests.WithLabelValues(op),
			errors:   m.errors.WithLabelValues(op),
			bytes:    m.bytes.WithLabelValues(op),
			latency:  m.latency.WithLabelValues(op),
		}
	}
	m.reg.MustRegister(m.requests, m.errors, m.bytes, m.latency, m.fua, m.conns, m.accepted, m.lookups,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// watchImage adds the metadata-cache counters of img, labelled name.
func (m *metrics) watchImage(img *qcow2.Image, name string) {
	m.reg.MustRegister(qcow2.NewCollector(img, name))
}

// connState tracks connections; chain it in front of another ConnState.
func (m *metrics) connState(next func(net.Conn, nbd.ConnState)) func(net.Conn, nbd.ConnState) {
	return func(c net.Conn, s nbd.ConnState) {
		switch s {
		case nbd.StateNew:
			m.accepted.Inc()
		case nbd.StateNegotiating:
			m.conns.WithLabelValues("negotiating").Inc()
		case nbd.StateTransmission:
			m.conns.WithLabelValues("negotiating").Dec()
			m.conns.WithLabelValues("transmission").Inc()
		case nbd.StateClosed:
			// Closed follows New (refused), Negotiating or Transmission;
			// the connection's own record says which gauge to lower.
			if st, ok := m.states.LoadAndDelete(c); ok {
				if g := st.(string); g != "" {
					m.conns.WithLabelValues(g).Dec()
				}
			}
		}
		switch s {
		case nbd.StateNegotiating:
			m.states.Store(c, "negotiating")
		case nbd.StateTransmission:
			m.states.Store(c, "transmission")
		}
		if next != nil {
			next(c, s)
		}
	}
}

// serveHTTP serves /metrics (and Go's /debug/pprof/) on addr until stop is called. It returns once
// the listener is bound, so a bad address fails the start of ovis nbd.
func (m *metrics) serveHTTP(addr string, ln net.Listener, log *slog.Logger) (stop func(), err error) {
	if ln == nil {
		if ln, err = net.Listen("tcp", addr); err != nil {
			return nil, fmt.Errorf("metrics: listen on %s: %w", addr, err)
		}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}))
	// Profiles of a live server, for the benchmarks; the address is the
	// operator's choice, like the metrics it sits beside.
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server failed", "addr", ln.Addr().String(), "err", err)
		}
	}()
	log.Info("metrics", "addr", ln.Addr().String(), "path", "/metrics")
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		<-done
	}, nil
}

// blockStatus counts a client's BLOCK_STATUS request (nbd.Config.BlockStatus),
// its length as bytes: the device only sees the extent lookups it takes.
func (m *metrics) blockStatus(length int64, took time.Duration, err error) {
	o := m.ops[opBlockStatus]
	o.requests.Inc()
	o.latency.Observe(took.Seconds())
	if err != nil {
		o.errors.Inc()
		return
	}
	o.bytes.Add(float64(length))
}

// metricsDevice counts the operations the NBD server issues to the device.
// They follow the client's requests, except that a long read of a hole may
// be answered from block status without a device read, and that extent
// lookups are counted apart (metrics.lookups). Every other method is the
// device's own.
type metricsDevice struct {
	block.Device
	m *metrics
}

var _ block.Device = metricsDevice{}

func (d metricsDevice) observe(op string, start time.Time, n int64, err error) {
	o := d.m.ops[op]
	o.requests.Inc()
	o.latency.Observe(time.Since(start).Seconds())
	if err != nil {
		o.errors.Inc()
		return
	}
	if n > 0 {
		o.bytes.Add(float64(n))
	}
}

func (d metricsDevice) ReadAt(p []byte, off int64) (int, error) {
	start := time.Now()
	n, err := d.Device.ReadAt(p, off)
	d.observe(opRead, start, int64(n), err)
	return n, err
}

// ReadNoWait counts the reads the device serves at once as reads.
func (d metricsDevice) ReadNoWait(p []byte, off int64) bool {
	start := time.Now()
	if !block.ReadNoWait(d.Device, p, off) {
		return false
	}
	d.observe(opRead, start, int64(len(p)), nil)
	return true
}

func (d metricsDevice) WriteAt(p []byte, off int64, fua bool) (int, error) {
	start := time.Now()
	n, err := d.Device.WriteAt(p, off, fua)
	d.observe(opWrite, start, int64(n), err)
	if fua && err == nil {
		d.m.fua.Inc()
	}
	return n, err
}

func (d metricsDevice) WriteZeroes(off, n int64, mayUnmap, fua bool) error {
	start := time.Now()
	err := d.Device.WriteZeroes(off, n, mayUnmap, fua)
	d.observe(opWriteZeroes, start, n, err)
	if fua && err == nil {
		d.m.fua.Inc()
	}
	return err
}

func (d metricsDevice) Discard(off, n int64) error {
	start := time.Now()
	err := d.Device.Discard(off, n)
	d.observe(opDiscard, start, n, err)
	return err
}

func (d metricsDevice) Flush() error {
	start := time.Now()
	err := d.Device.Flush()
	d.observe(opFlush, start, 0, err)
	return err
}

func (d metricsDevice) Extent(off, n int64) (block.Extent, error) {
	d.m.lookups.Inc()
	return d.Device.Extent(off, n)
}
