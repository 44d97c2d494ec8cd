package node

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// Metrics counts what reaches a node over the node-to-node protocol. The
// direct-write study reads them: a FUA write from a client must show as
// one sync write per replica and no flush.
type Metrics struct {
	requests   *prometheus.CounterVec   // by op and status
	latency    *prometheus.HistogramVec // by op
	syncWrites prometheus.Counter
	flushes    prometheus.Counter
	bytesIn    prometheus.Counter
	bytesOut   prometheus.Counter
	Locks      prometheus.Gauge
	Rejoins    prometheus.Counter
	CutOffs    prometheus.Counter
	gateWaits  prometheus.Counter

	reg prometheus.Registerer
}

// watchNode adds the gauges read from the node when scraped: its epoch,
// and the objects and bytes its store holds (recounted at most every
// 10 s: the count walks the store).
func (m *Metrics) watchNode(n *Node) {
	if m.reg == nil {
		return
	}
	var (
		mu   sync.Mutex
		last time.Time
		u    store.Usage
	)
	usage := func() store.Usage {
		mu.Lock()
		defer mu.Unlock()
		if time.Since(last) > 10*time.Second {
			if nu, err := n.st.Usage(); err == nil {
				u, last = nu, time.Now()
			}
		}
		return u
	}
	m.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_node_epoch", Help: "The membership epoch the node is at."},
			func() float64 { return float64(n.views.Epoch()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_node_full", Help: "1 while the node's disk is at its reserve and the node is out of placement."},
			func() float64 { return b2f(n.full.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_node_unreachable_peers", Help: "Peers of the epoch this node has reported unreachable."},
			func() float64 { return float64(n.unreachable.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_node_objects", Help: "Objects held."},
			func() float64 { return float64(usage().Objects) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_node_allocated_bytes", Help: "Bytes the objects held take on disk."},
			func() float64 { return float64(usage().Allocated) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_node_free_bytes", Help: "Free bytes on the store's filesystem."},
			func() float64 { return float64(usage().Free) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ovis_recovery_unfound_objects",
			Help: "Objects placed on this node whose newest copy may be on nodes that are away: nobody serves them until one returns."},
			func() float64 {
				n.rec.mu.Lock()
				defer n.rec.mu.Unlock()
				return float64(n.rec.objs.UnavailableCount())
			}),
	)
}

// NewMetrics registers a node's metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ovis_node_requests_total", Help: "Requests served, by op and status.",
		}, []string{"op", "status"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "ovis_node_request_seconds", Help: "Time to serve a request, by op.",
			Buckets: prometheus.ExponentialBuckets(10e-6, 2, 18),
		}, []string{"op"}),
		syncWrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ovis_node_sync_writes_total", Help: "Writes and zero writes with the sync flag (FUA).",
		}),
		flushes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ovis_node_flushes_total", Help: "Flushes of a VDI.",
		}),
		bytesIn: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ovis_node_written_bytes_total", Help: "Bytes written.",
		}),
		bytesOut: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ovis_node_read_bytes_total", Help: "Bytes read.",
		}),
		Locks:   prometheus.NewGauge(prometheus.GaugeOpts{Name: "ovis_node_vdi_locks", Help: "VDI locks this node's gateway holds."}),
		Rejoins: prometheus.NewCounter(prometheus.CounterOpts{Name: "ovis_node_lease_losses_total", Help: "Times the node lost its membership lease and rejoined (or is rejoining)."}),
		CutOffs: prometheus.NewCounter(prometheus.CounterOpts{Name: "ovis_node_cut_off_total", Help: "Times the node left the epoch for being cut off from its peers while it reached etcd."}),
		gateWaits: prometheus.NewCounter(prometheus.CounterOpts{Name: "ovis_node_gate_waits_total",
			Help: "Reads, extents and checksums that waited for a gated write over their range to be settled (docs/protocol.md, the read model)."}),
		reg: reg,
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.latency, m.syncWrites, m.flushes, m.bytesIn, m.bytesOut, m.Locks, m.Rejoins, m.CutOffs, m.gateWaits)
	}
	return m
}

func (m *Metrics) observe(req *protocol.Request, resp *protocol.Response, d time.Duration) {
	op := req.Op.String()
	m.requests.WithLabelValues(op, resp.Status.String()).Inc()
	m.latency.WithLabelValues(op).Observe(d.Seconds())
	if resp.Status != protocol.StatusOK {
		return
	}
	switch req.Op {
	case protocol.OpWrite, protocol.OpWriteZeroes:
		if req.Flags&protocol.FlagSync != 0 {
			m.syncWrites.Inc()
		}
		if req.Op == protocol.OpWrite {
			m.bytesIn.Add(float64(len(req.Payload)))
		}
	case protocol.OpFlush:
		m.flushes.Inc()
	case protocol.OpRead:
		m.bytesOut.Add(float64(len(resp.Payload)))
	}
}

// b2f is 1 for true.
func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
