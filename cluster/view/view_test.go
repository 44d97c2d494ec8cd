package view

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/placement"
)

// TestAttemptEndsWithView: a try on a view is abandoned when a newer
// view supersedes it, and a view built as a literal never is.
func TestAttemptEndsWithView(t *testing.T) {
	nodes := []placement.Node{{ID: "a", Weight: 1}, {ID: "b", Weight: 1}}
	if _, err := New(3, nodes, map[string]string{"a": "127.0.0.1:1"}); err == nil {
		t.Fatal("a view with a node without an address was built")
	}
	v, err := New(3, nodes, map[string]string{"a": "127.0.0.1:1", "b": "127.0.0.1:2"})
	if err != nil {
		t.Fatal(err)
	}
	// A node with an address but not placed (a full one) is still one
	// of the epoch's.
	withFull, err := New(3, nodes, map[string]string{"b": "127.0.0.1:2", "c": "127.0.0.1:3", "a": "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := withFull.IDs(); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("IDs %v, want a b c", got)
	}
	actx, stop := v.Attempt(context.Background())
	defer stop()
	if actx.Err() != nil {
		t.Fatal("a try on a current view ended at once")
	}
	v.Supersede()
	select {
	case <-actx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a try on a superseded view goes on")
	}
	lit := &View{Epoch: 1}
	lctx, lstop := lit.Attempt(context.Background())
	lit.Supersede()
	if lctx.Err() != nil {
		t.Fatal("a literal view's try ended")
	}
	lstop()
}

// TestStatic: a static source hands its view for an older epoch at once,
// and waits (until ctx ends) for a newer one that never comes.
func TestStatic(t *testing.T) {
	s := Static{V: &View{Epoch: 4}}
	if v, err := s.Await(context.Background(), 3); err != nil || v.Epoch != 4 {
		t.Fatalf("await after epoch 3: %v, %v", v, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := s.Await(ctx, 4); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("await after epoch 4: %v, want the context's end", err)
	}
}
