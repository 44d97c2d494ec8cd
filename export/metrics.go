package export

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ovis-storage/ovis/block"
)

// Metrics are the Prometheus metrics of the requests an exported device
// serves, by operation: requests, bytes, errors and latency, FUA writes,
// and the extent lookups the server makes on its own. Wrap a device with
// Wrap; count a client's BLOCK_STATUS requests with BlockStatus (the
// device sees only the lookups they take).
//
// Safe for concurrent use.
type Metrics struct {
	requests *prometheus.CounterVec
	errors   *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	fua      prometheus.Counter
	// lookups counts the device's extent lookups: the server's own (one
	// per sparse read, one or more per BLOCK_STATUS request), apart
	// from the clients' BLOCK_STATUS requests that op="block_status"
	// counts.
	lookups prometheus.Counter

	// ops holds each operation's children of the vectors, resolved once
	// so that a request does not hash its label.
	ops map[string]*opMetrics
}

type opMetrics struct {
	requests, errors, bytes prometheus.Counter
	latency                 prometheus.Observer
}

// Operation labels of the request metrics.
const (
	OpRead        = "read"
	OpWrite       = "write"
	OpWriteZeroes = "write_zeroes"
	OpDiscard     = "discard"
	OpFlush       = "flush"
	OpBlockStatus = "block_status"
)

// NewMetrics makes the request metrics and registers them on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{}
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
	m.lookups = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ovis_block_extent_lookups_total",
		Help: "Allocation lookups on the device: a sparse read's hole map and the walk of each BLOCK_STATUS request.",
	})
	m.ops = map[string]*opMetrics{}
	for _, op := range []string{OpRead, OpWrite, OpWriteZeroes, OpDiscard, OpFlush, OpBlockStatus} {
		m.ops[op] = &opMetrics{
			requests: m.requests.WithLabelValues(op),
			errors:   m.errors.WithLabelValues(op),
			bytes:    m.bytes.WithLabelValues(op),
			latency:  m.latency.WithLabelValues(op),
		}
	}
	reg.MustRegister(m.requests, m.errors, m.bytes, m.latency, m.fua, m.lookups)
	return m
}

// BlockStatus counts a client's BLOCK_STATUS request (nbd.Config's
// BlockStatus hook), its length as bytes.
func (m *Metrics) BlockStatus(length int64, took time.Duration, err error) {
	o := m.ops[OpBlockStatus]
	o.requests.Inc()
	o.latency.Observe(took.Seconds())
	if err != nil {
		o.errors.Inc()
		return
	}
	o.bytes.Add(float64(length))
}

// Wrap returns d with its requests counted. Put it outermost, so that it
// times what the client waits for.
func (m *Metrics) Wrap(d block.Device) block.Device { return metricsDevice{Device: d, m: m} }

// metricsDevice counts the operations the NBD server issues to the device.
// They follow the client's requests, except that a long read of a hole may
// be answered from block status without a device read, and that extent
// lookups are counted apart (Metrics.lookups).
type metricsDevice struct {
	block.Device
	m *Metrics
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

func (d metricsDevice) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	start := time.Now()
	n, err := d.Device.ReadAt(ctx, p, off)
	d.observe(OpRead, start, int64(n), err)
	return n, err
}

// ReadNoWait counts the reads the device beneath serves at once as
// reads. It is the one optional method a wrapper here implements: it
// changes what the method does (it counts), which block.As could not.
func (d metricsDevice) ReadNoWait(p []byte, off int64) bool {
	start := time.Now()
	if !block.ReadNoWait(d.Device, p, off) {
		return false
	}
	d.observe(OpRead, start, int64(len(p)), nil)
	return true
}

func (d metricsDevice) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	start := time.Now()
	n, err := d.Device.WriteAt(ctx, p, off, f)
	d.observe(OpWrite, start, int64(n), err)
	if f.Has(block.FUA) && err == nil {
		d.m.fua.Inc()
	}
	return n, err
}

func (d metricsDevice) WriteZeroes(ctx context.Context, off, n int64, f block.Flags) error {
	start := time.Now()
	err := d.Device.WriteZeroes(ctx, off, n, f)
	d.observe(OpWriteZeroes, start, n, err)
	if f.Has(block.FUA) && err == nil {
		d.m.fua.Inc()
	}
	return err
}

func (d metricsDevice) Discard(ctx context.Context, off, n int64, f block.Flags) error {
	start := time.Now()
	err := d.Device.Discard(ctx, off, n, f)
	d.observe(OpDiscard, start, n, err)
	return err
}

func (d metricsDevice) Flush(ctx context.Context) error {
	start := time.Now()
	err := d.Device.Flush(ctx)
	d.observe(OpFlush, start, 0, err)
	return err
}

func (d metricsDevice) Extents(ctx context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	d.m.lookups.Inc()
	return d.Device.Extents(ctx, off, n, dst)
}

func (d metricsDevice) Unwrap() block.Device { return d.Device }
