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

	"github.com/ovis-storage/ovis/export"
	"github.com/ovis-storage/ovis/nbd"
	"github.com/ovis-storage/ovis/qcow2"
)

// metrics are the Prometheus metrics of one served export: the device's
// requests (export.Metrics), client connections, the qcow2 metadata
// caches, and the Go runtime and process. They live on a registry of
// their own, never the global one, so that two servers in one process
// (tests) do not collide.
type metrics struct {
	*export.Metrics
	reg *prometheus.Registry

	conns    *prometheus.GaugeVec
	accepted prometheus.Counter
	// states is each open connection's gauge label ("negotiating",
	// "transmission"); nbd reports one connection's states in order.
	states sync.Map
}

func newMetrics() *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.Metrics = export.NewMetrics(m.reg)
	m.conns = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "ovis_nbd_connections", Help: "Open client connections, by state (negotiating, transmission).",
	}, []string{"state"})
	m.accepted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ovis_nbd_connections_accepted_total", Help: "Client connections accepted.",
	})
	m.reg.MustRegister(m.conns, m.accepted,
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
