package nodeproc

import (
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The real node's lines are read by every process test in cmd/ovis and
// by bench/chaos; these pin what Start and Ready do around them.

func TestReadyReadsAnnouncements(t *testing.T) {
	t.Parallel()
	var echoed []string
	p, err := Start(exec.Command("sh", "-c", `
echo 'metrics at http://127.0.0.1:9100/metrics'
echo 'ovis node vm-1 serving on 127.0.0.1:7000'
echo 'another node joins with: ovis node --dir DIR --etcd http://127.0.0.1:2379 --listen HOST:PORT'
echo 'VDIs are served at nbd://127.0.0.1:10809/NAME'
exec sleep 60`), func(l string) { echoed = append(echoed, l) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Ready(ctx); err != nil {
		t.Fatal(err)
	}
	if p.ID != "vm-1" || p.Addr != "127.0.0.1:7000" || p.Etcd != "http://127.0.0.1:2379" || p.Metrics != "127.0.0.1:9100" || p.NBD != "127.0.0.1:10809" {
		t.Errorf("announced %+v", *p)
	}
	if p.Err() != nil {
		t.Errorf("Err before the end: %v", p.Err())
	}
	if err := p.Stop(syscall.SIGTERM, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if p.Err() == nil || !strings.Contains(p.Err().Error(), "terminated") {
		t.Errorf("Err after SIGTERM: %v", p.Err())
	}
	if len(echoed) != 4 {
		t.Errorf("echoed %d lines, want 4: %q", len(echoed), echoed)
	}
}

func TestReadyFailsWhenTheNodeExits(t *testing.T) {
	t.Parallel()
	p, err := Start(exec.Command("sh", "-c", "echo 'ovis node vm-1 serving on 127.0.0.1:7000'; exit 3"), nil)
	if err != nil {
		t.Fatal(err)
	}
	err = p.Ready(context.Background())
	if err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Errorf("Ready: %v, want the exit status", err)
	}
}

func TestReadyTimesOutAndStopKills(t *testing.T) {
	t.Parallel()
	// The shell ignores SIGTERM: Stop must kill it after the wait.
	p, err := Start(exec.Command("sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := p.Ready(ctx); err == nil {
		t.Fatal("Ready of a silent process succeeded")
	}
	if err := p.Stop(syscall.SIGTERM, 200*time.Millisecond); err != ErrKilled {
		t.Errorf("Stop: %v, want ErrKilled", err)
	}
	select {
	case <-p.Exited():
	default:
		t.Error("Exited not closed after Stop")
	}
}
