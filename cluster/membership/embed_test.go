package membership

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
)

// TestEmbeddedRestart stops an embedded etcd and starts it again on its
// data dir, as `ovis up` does: the data is still there.
func TestEmbeddedRestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := EmbedConfig{Dir: dir, ClientURL: "http://127.0.0.1:0", PeerURL: "http://127.0.0.1:0"}
	e, err := StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c, err := Connect(ctx, Config{Endpoints: e.Endpoints(), Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Format(ctx, Format{Copies: 1}, false); err != nil {
		t.Fatal(err)
	}
	f, _ := c.GetFormat(ctx)
	c.Close()
	if err := c.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Client.Close: %v", err)
	}
	if ch := c.Watch(ctx); ch != nil {
		if _, ok := <-ch; ok {
			t.Fatal("Watch on a closed client delivered a view")
		}
	}
	e.Close()

	e, err = StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatalf("restart on the same dir: %v", err)
	}
	defer e.Close()
	c = newClient(t, e.Endpoints(), DefaultPrefix)
	if g, err := c.GetFormat(ctx); err != nil || g != f {
		t.Fatalf("format after restart: %+v, %v; want %+v", g, err, f)
	}
}

// TestEmbeddedAdvertised listens on one address and advertises a
// name with port 0: the advertised URL gets the real port, and works.
func TestEmbeddedAdvertised(t *testing.T) {
	t.Parallel()
	e, err := StartEmbedded(ctx, EmbedConfig{Dir: t.TempDir(), ClientURL: "http://127.0.0.1:0", AdvertiseClientURL: "http://localhost:0", PeerURL: "http://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	u := e.AdvertisedURL()
	if !strings.HasPrefix(u, "http://localhost:") || strings.HasSuffix(u, ":0") {
		t.Fatalf("AdvertisedURL = %q", u)
	}
	c := newClient(t, []string{u}, "")
	if _, err := c.GetFormat(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("GetFormat through %s: %v", u, err)
	}
}

func TestStartEmbeddedErrors(t *testing.T) {
	t.Parallel()
	if _, err := StartEmbedded(ctx, EmbedConfig{}); err == nil {
		t.Fatal("StartEmbedded with no dir succeeded")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := StartEmbedded(cctx, EmbedConfig{Dir: t.TempDir(), ClientURL: "http://127.0.0.1:0", PeerURL: "http://127.0.0.1:0"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("StartEmbedded with a cancelled context: %v", err)
	}
	// The shared member holds its client port.
	used := shared.Endpoints()[0]
	if _, err := StartEmbedded(ctx, EmbedConfig{Dir: t.TempDir(), ClientURL: used, PeerURL: "http://127.0.0.1:0"}); err == nil {
		t.Fatalf("StartEmbedded on the used port %s succeeded", used)
	}
}

// recordHandler keeps the records it handles.
type recordHandler struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs = append(h.recs, r)
	return nil
}
func (h *recordHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordHandler) WithGroup(string) slog.Handler      { return h }

func TestSlogCore(t *testing.T) {
	h := &recordHandler{}
	lg := zap.New(slogCore{log: slog.New(h), min: zap.WarnLevel}).With(zap.String("member", "m0"))
	lg.Info("dropped")
	lg.Warn("slow fdatasync", zap.Int("took-ms", 1200))
	lg.Error("lost leader")
	if len(h.recs) != 2 {
		t.Fatalf("%d records, want 2 (info is below the minimum)", len(h.recs))
	}
	r := h.recs[0]
	if r.Level != slog.LevelWarn || r.Message != "slow fdatasync" {
		t.Fatalf("record %v %q", r.Level, r.Message)
	}
	var attrs []string
	r.Attrs(func(a slog.Attr) bool { attrs = append(attrs, a.String()); return true })
	got := strings.Join(attrs, " ")
	for _, want := range []string{"component=etcd", "member=m0", "took-ms=1200"} {
		if !strings.Contains(got, want) {
			t.Errorf("attrs %q lack %q", got, want)
		}
	}
	if h.recs[1].Level != slog.LevelError {
		t.Fatalf("error logged at %v", h.recs[1].Level)
	}
}
