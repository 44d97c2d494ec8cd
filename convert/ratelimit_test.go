package convert

import (
	"context"
	"testing"
	"time"
)

// TestRateLimiter requires n bytes to take at least n/rate seconds however
// many goroutines write, and a cancelled context to end the wait.
func TestRateLimiter(t *testing.T) {
	if NewRateLimiter(0) != nil {
		t.Fatal("a rate of 0 limits")
	}
	r := NewRateLimiter(1 << 20)
	start := time.Now()
	done := make(chan error)
	for range 4 {
		go func() { done <- r.Wait(context.Background(), 64<<10) }()
	}
	for range 4 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 250*time.Millisecond {
		t.Fatalf("256 KiB at 1 MiB/s took %v, want at least 250ms", d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.Wait(ctx, 1<<30); err == nil {
		t.Fatal("wait ignored a cancelled context")
	}
}
