package membership

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// compactTarget is the compactor's rule, pure: with the store at
// revision rev and compacted up to done, keep the newest keep revisions.
// It returns the revision to compact to, or false when there is nothing
// to do.
func compactTarget(rev, keep, done int64) (int64, bool) {
	t := rev - keep
	if t <= done || t <= 0 {
		return 0, false
	}
	return t, true
}

// StartCompactor compacts etcd's history every interval, keeping the
// newest keep revisions, for an external etcd whose own
// auto-compaction is off (an embedded one compacts by itself). It stops
// when ctx ends or the Client closes. Several nodes may run it: a
// compaction to a revision already compacted is harmless. keep below
// 100 is raised to 100 and interval below 100 ms to 100 ms.
func (c *Client) StartCompactor(ctx context.Context, keep int64, interval time.Duration) {
	keep = max(keep, 100)
	interval = max(interval, 100*time.Millisecond)
	ctx, cancel := context.WithCancel(ctx)
	started := c.goTracked(func() {
		defer cancel()
		stop := context.AfterFunc(c.bg, cancel)
		defer stop()
		t := time.NewTicker(interval)
		defer t.Stop()
		var done int64
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			var err error
			if done, err = c.compactOnce(ctx, keep, done); err != nil && ctx.Err() == nil {
				c.log.Warn("compaction failed", "err", err)
			}
		}
	})
	if !started {
		cancel()
	}
}

// compactOnce compacts to keep revisions behind the current one, and
// returns the revision compacted to.
func (c *Client) compactOnce(ctx context.Context, keep, done int64) (int64, error) {
	resp, err := c.cli.Get(ctx, c.k.format(), clientv3.WithCountOnly())
	if err != nil {
		return done, fmt.Errorf("membership: compact: read revision: %w", err)
	}
	t, ok := compactTarget(resp.Header.Revision, keep, done)
	if !ok {
		return done, nil
	}
	if _, err := c.cli.Compact(ctx, t); err != nil {
		if errors.Is(err, rpctypes.ErrCompacted) {
			return t, nil // another node compacted as far or further
		}
		return done, fmt.Errorf("membership: compact to %d: %w", t, err)
	}
	return t, nil
}
