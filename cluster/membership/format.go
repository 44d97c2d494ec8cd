package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Format is the cluster's format record: the defaults every VDI takes
// unless it says otherwise.
type Format struct {
	// ClusterID names the cluster; Format makes one up when it is empty.
	ClusterID string `json:"cluster_id"`
	// Copies is the default number of replicas of an object, at least 1.
	Copies int `json:"copies"`
	// ObjectShift is the default object size as a power of two; 0
	// means object.DefaultSizeShift.
	ObjectShift uint8 `json:"object_shift"`
	// Created is when the cluster was formatted; Format sets it when it
	// is zero.
	Created time.Time `json:"created"`
	// Strict refuses writes while fewer failure domains are live than a
	// VDI has copies (Sheepdog's --strict), rather than writing fewer
	// copies until recovery makes the rest.
	Strict bool `json:"strict,omitempty"`
}

// MaxCopies bounds Format.Copies and VDI.Copies.
const MaxCopies = 16

// Validate reports a Format field out of range, naming its value.
func (f Format) Validate() error {
	if f.Copies < 1 || f.Copies > MaxCopies {
		return fmt.Errorf("membership: format: copies %d: want 1 to %d: %w", f.Copies, MaxCopies, ErrInvalid)
	}
	if f.ObjectShift != 0 {
		if err := validShift(f.ObjectShift); err != nil {
			return fmt.Errorf("membership: format: %w", err)
		}
	}
	return nil
}

// ZonesError refuses more copies than the cluster has zones (failure
// domains): placement puts the copies of an object in distinct zones,
// so the extra copies could go nowhere. It wraps ErrInvalid.
type ZonesError struct {
	Copies, Zones int
}

func (e *ZonesError) Error() string {
	return fmt.Sprintf("copies %d: the cluster has %d nodes (failure domains); start more nodes first", e.Copies, e.Zones)
}

// Is makes a ZonesError an ErrInvalid.
func (e *ZonesError) Is(target error) bool { return target == ErrInvalid }

// NewFormat fills a format's defaults (Copies 0 is 1) and checks it for
// a cluster of zones zones: a *ZonesError when its copies are more, or
// Validate's error. Every entry point that formats (the admin plane,
// ovis up, tests) goes through it, by FormatIn. Pure.
func NewFormat(f Format, zones int) (Format, error) {
	if f.Copies == 0 {
		f.Copies = 1
	}
	if f.Copies > zones {
		return Format{}, &ZonesError{Copies: f.Copies, Zones: zones}
	}
	if err := f.Validate(); err != nil {
		return Format{}, err
	}
	return f, nil
}

// FormatIn formats the cluster with f as Format does, once NewFormat
// has filled its defaults and checked it against the zones of v, the
// view it is made in; it returns the record as stored. It returns
// NewFormat's errors and Format's (ErrFormatted without force).
func (c *Client) FormatIn(ctx context.Context, v View, f Format, force bool) (Format, error) {
	f, err := NewFormat(f, v.Zones())
	if err != nil {
		return Format{}, err
	}
	if err := c.Format(ctx, f, force); err != nil {
		return Format{}, err
	}
	return c.GetFormat(ctx)
}

// validShift checks an object size given as a shift.
func validShift(s uint8) error {
	if s < object.MinSizeShift || s > object.MaxSizeShift {
		return fmt.Errorf("object size 2^%d: want a power of two from 1 MiB to 64 MiB: %w", s, ErrInvalid)
	}
	return nil
}

// Format writes the cluster's format record. It returns ErrFormatted
// when one exists and force is false; with force it replaces it (the
// VDI table is left as it is: each VDI keeps its own copies and object
// size). A zero ObjectShift is stored as object.DefaultSizeShift, an
// empty ClusterID as a random one, a zero Created as now.
func (c *Client) Format(ctx context.Context, f Format, force bool) error {
	if err := f.Validate(); err != nil {
		return err
	}
	if f.ObjectShift == 0 {
		f.ObjectShift = object.DefaultSizeShift
	}
	if f.Created.IsZero() {
		f.Created = c.now().UTC()
	}
	if f.ClusterID == "" {
		f.ClusterID = randomID()
	}
	b, err := json.Marshal(f)
	if err != nil {
		return fmt.Errorf("membership: format: %w", err)
	}
	if force {
		if _, err := c.cli.Put(ctx, c.k.format(), string(b)); err != nil {
			return fmt.Errorf("membership: format: put %s: %w", c.k.format(), err)
		}
		return nil
	}
	resp, err := c.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(c.k.format()), "=", 0)).
		Then(clientv3.OpPut(c.k.format(), string(b))).
		Commit()
	if err != nil {
		return fmt.Errorf("membership: format: put %s: %w", c.k.format(), err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("membership: format: %w", ErrFormatted)
	}
	return nil
}

// GetFormat reads the format record, or returns ErrNotFormatted.
func (c *Client) GetFormat(ctx context.Context) (Format, error) {
	resp, err := c.cli.Get(ctx, c.k.format())
	if err != nil {
		return Format{}, fmt.Errorf("membership: get %s: %w", c.k.format(), err)
	}
	if len(resp.Kvs) == 0 {
		return Format{}, ErrNotFormatted
	}
	return decodeFormat(resp.Kvs[0].Value)
}

func decodeFormat(b []byte) (Format, error) {
	var f Format
	if err := json.Unmarshal(b, &f); err != nil {
		return Format{}, fmt.Errorf("membership: format record %q: %w", b, err)
	}
	if err := f.Validate(); err != nil {
		return Format{}, fmt.Errorf("membership: format record %q: %w", b, err)
	}
	return f, nil
}
