package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ovis-storage/ovis/cluster/object"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// VDI is one virtual disk's record in the VDI table.
type VDI struct {
	// ID is handed out by CreateVDI from a counter that never goes back,
	// so an id names one VDI for the life of the cluster.
	ID object.VDI `json:"id"`
	// Name is 1 to 255 bytes of printable UTF-8, no '/'.
	Name string `json:"name"`
	// Size in bytes: a multiple of 512, at most object.MaxVDISize.
	Size int64 `json:"size"`
	// Copies of each object; 0 in CreateVDI means the format's.
	Copies int `json:"copies"`
	// ObjectShift is the object size as a power of two; 0 in CreateVDI
	// means the format's.
	ObjectShift uint8 `json:"object_shift"`
	// State is StateReady once created.
	State string `json:"state"`
	// Parent is the VDI this one was cloned or snapshotted from; 0 for
	// none (snapshots and clones come later).
	Parent object.VDI `json:"parent,omitempty"`
	// Created is set by CreateVDI when zero.
	Created time.Time `json:"created"`
	// Epoch is the membership epoch when the VDI was created (read
	// before the record is written, so no later than the true one): a
	// node that was one of an object's replicas in every epoch since
	// then has received every write of it.
	Epoch uint64 `json:"epoch"`
	// CopiesBefore is what AlterCopies changed, oldest first: the VDI
	// had CopiesBefore[i].Copies in the epochs below
	// CopiesBefore[i].Until (and at or past the previous entry's), and
	// Copies from the last entry's Until on. CopiesAt reads it.
	CopiesBefore []CopiesChange `json:"copies_before,omitempty"`
	// CopiesKnownFrom is the first epoch whose copies the record still
	// knows: older entries of CopiesBefore were dropped (at most
	// MaxCopiesHistory are kept). 0: every epoch since creation.
	CopiesKnownFrom uint64 `json:"copies_known_from,omitempty"`
	// Allocation: the VDI keeps an allocation map (Allocated), so every
	// object that may hold data is in it. Set by CreateVDI; VDIs made
	// before maps existed have none, and their lost objects are known
	// only through the recovery of the nodes placed for them.
	Allocation bool `json:"allocation,omitempty"`
}

// StateReady is the State of a VDI that can be served.
const StateReady = "ready"

// MaxNameLen bounds VDI names and node IDs, in bytes.
const MaxNameLen = 255

// ObjectSize returns the VDI's object size in bytes.
func (v VDI) ObjectSize() int64 { return 1 << v.ObjectShift }

// Tombstone records a deleted VDI: recovery uses it to drop objects of
// the VDI that a node kept while it was away.
type Tombstone struct {
	ID      object.VDI `json:"id"`
	Name    string     `json:"name"`
	Size    int64      `json:"size"`
	Deleted time.Time  `json:"deleted"`
}

// validName checks a VDI name or node ID.
func validName(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("name is empty: %w", ErrInvalid)
	case len(s) > MaxNameLen:
		return fmt.Errorf("name of %d bytes: want at most %d: %w", len(s), MaxNameLen, ErrInvalid)
	case !utf8.ValidString(s):
		return fmt.Errorf("name %q is not valid UTF-8: %w", s, ErrInvalid)
	case strings.Contains(s, "/"):
		return fmt.Errorf("name %q has a '/': %w", s, ErrInvalid)
	case s == "." || s == "..":
		return fmt.Errorf("name %q is reserved: %w", s, ErrInvalid)
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return fmt.Errorf("name %q has the non-printable character %U: %w", s, r, ErrInvalid)
		}
	}
	return nil
}

// withDefaults fills Copies and ObjectShift from the format.
func (v VDI) withDefaults(f Format) VDI {
	if v.Copies == 0 {
		v.Copies = f.Copies
	}
	if v.ObjectShift == 0 {
		v.ObjectShift = f.ObjectShift
		if v.ObjectShift == 0 {
			v.ObjectShift = object.DefaultSizeShift
		}
	}
	return v
}

// NewVDI fills v's Copies and ObjectShift from the format when they are
// 0 and checks the result as ValidateVDI does, for a cluster of zones
// zones; it returns the VDI as CreateVDI stores it, but for its id,
// state and times. Every entry point that creates a VDI goes through it
// (CreateVDI does). Pure.
func NewVDI(v VDI, f Format, zones int) (VDI, error) {
	if err := ValidateVDI(v, f, zones); err != nil {
		return VDI{}, err
	}
	return v.withDefaults(f), nil
}

// ValidateVDI checks v as CreateVDI would, with zones the failure
// domains of the current view (View.Zones). Copies and ObjectShift of 0
// take the format's. The error wraps ErrInvalid and names the value.
func ValidateVDI(v VDI, f Format, zones int) error {
	if err := validName(v.Name); err != nil {
		return fmt.Errorf("vdi: %w", err)
	}
	v = v.withDefaults(f)
	if err := validShift(v.ObjectShift); err != nil {
		return fmt.Errorf("vdi %q: %w", v.Name, err)
	}
	if v.Size <= 0 {
		return fmt.Errorf("vdi %q: size %d: want more than 0: %w", v.Name, v.Size, ErrInvalid)
	}
	if v.Size%512 != 0 {
		return fmt.Errorf("vdi %q: size %d: not a multiple of 512: %w", v.Name, v.Size, ErrInvalid)
	}
	if max := object.MaxVDISize(v.ObjectSize()); v.Size > max {
		return fmt.Errorf("vdi %q: size %d: more than %d, the most objects of %d bytes can hold: %w",
			v.Name, v.Size, max, v.ObjectSize(), ErrInvalid)
	}
	if v.Copies < 1 || v.Copies > MaxCopies {
		return fmt.Errorf("vdi %q: copies %d: want 1 to %d: %w", v.Name, v.Copies, MaxCopies, ErrInvalid)
	}
	if v.Copies > zones {
		return fmt.Errorf("vdi %q: copies %d: more than the %d zones of the cluster: %w", v.Name, v.Copies, zones, ErrInvalid)
	}
	return nil
}

// CreateVDI adds v to the VDI table with a new id and returns the
// stored record. The format fills Copies and ObjectShift when 0, and
// copies may not exceed the current view's zones. It returns
// ErrNotFormatted, ErrNoEpoch (no node has joined), an ErrInvalid
// error, or ErrVDIExists.
func (c *Client) CreateVDI(ctx context.Context, v VDI) (VDI, error) {
	f, err := c.GetFormat(ctx)
	if err != nil {
		return VDI{}, fmt.Errorf("membership: create vdi %q: %w", v.Name, err)
	}
	view, err := c.View(ctx)
	if err != nil {
		return VDI{}, fmt.Errorf("membership: create vdi %q: %w", v.Name, err)
	}
	if v, err = NewVDI(v, f, view.Zones()); err != nil {
		return VDI{}, fmt.Errorf("membership: create %w", err)
	}
	v.State = StateReady
	v.Allocation = true
	v.Epoch = view.Epoch
	if v.Created.IsZero() {
		v.Created = c.now().UTC()
	}
	nameKey := c.k.vdiName(v.Name)
	for {
		// The counter and the name are checked in one txn: two creators
		// never get one id, and a lost race on the counter retries.
		resp, err := c.cli.Txn(ctx).Then(clientv3.OpGet(c.k.vdiNext()), clientv3.OpGet(nameKey, clientv3.WithCountOnly())).Commit()
		if err != nil {
			return VDI{}, fmt.Errorf("membership: create vdi %q: read %s: %w", v.Name, c.k.vdiNext(), err)
		}
		if resp.Responses[1].GetResponseRange().Count > 0 {
			return VDI{}, fmt.Errorf("membership: create vdi %q: %w", v.Name, ErrVDIExists)
		}
		next, nextMod := uint64(1), int64(0)
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			next, err = strconv.ParseUint(string(kvs[0].Value), 10, 32)
			if err != nil || next == 0 {
				return VDI{}, fmt.Errorf("membership: create vdi %q: counter %s holds %q", v.Name, c.k.vdiNext(), kvs[0].Value)
			}
			nextMod = kvs[0].ModRevision
		}
		if next > uint64(^object.VDI(0)) {
			return VDI{}, fmt.Errorf("membership: create vdi %q: vdi ids exhausted", v.Name)
		}
		v.ID = object.VDI(next)
		b, err := json.Marshal(v)
		if err != nil {
			return VDI{}, fmt.Errorf("membership: create vdi %q: %w", v.Name, err)
		}
		counter := clientv3.Compare(clientv3.ModRevision(c.k.vdiNext()), "=", nextMod)
		if nextMod == 0 {
			counter = clientv3.Compare(clientv3.CreateRevision(c.k.vdiNext()), "=", 0)
		}
		tr, err := c.cli.Txn(ctx).If(
			counter,
			clientv3.Compare(clientv3.CreateRevision(nameKey), "=", 0),
		).Then(
			clientv3.OpPut(nameKey, string(b)),
			clientv3.OpPut(c.k.vdiID(v.ID), v.Name),
			clientv3.OpPut(c.k.vdiNext(), strconv.FormatUint(next+1, 10)),
		).Commit()
		if err != nil {
			return VDI{}, fmt.Errorf("membership: create vdi %q: %w", v.Name, err)
		}
		if tr.Succeeded {
			return v, nil
		}
	}
}

// getVDI returns the record and its key's create and mod revisions.
func (c *Client) getVDI(ctx context.Context, name string) (VDI, int64, int64, error) {
	if err := validName(name); err != nil {
		return VDI{}, 0, 0, fmt.Errorf("membership: vdi: %w", err)
	}
	resp, err := c.cli.Get(ctx, c.k.vdiName(name))
	if err != nil {
		return VDI{}, 0, 0, fmt.Errorf("membership: get vdi %q: %w", name, err)
	}
	if len(resp.Kvs) == 0 {
		return VDI{}, 0, 0, fmt.Errorf("membership: vdi %q: %w", name, ErrNoVDI)
	}
	v, err := decodeVDI(resp.Kvs[0].Value)
	return v, resp.Kvs[0].CreateRevision, resp.Kvs[0].ModRevision, err
}

func decodeVDI(b []byte) (VDI, error) {
	var v VDI
	if err := json.Unmarshal(b, &v); err != nil {
		return VDI{}, fmt.Errorf("membership: vdi record %q: %w", b, err)
	}
	if v.ID == 0 {
		return VDI{}, fmt.Errorf("membership: vdi record %q: id 0", b)
	}
	return v, nil
}

// GetVDI returns the VDI named name, or ErrNoVDI.
func (c *Client) GetVDI(ctx context.Context, name string) (VDI, error) {
	v, _, _, err := c.getVDI(ctx, name)
	return v, err
}

// GetVDIRevision returns the VDI named name, or ErrNoVDI, with the etcd
// revision its record was last written at: of two reads, the one with
// the higher revision is the newer record (a resize, say).
func (c *Client) GetVDIRevision(ctx context.Context, name string) (VDI, int64, error) {
	v, _, mod, err := c.getVDI(ctx, name)
	return v, mod, err
}

// GetVDIByID returns the VDI with the id, or ErrNoVDI.
func (c *Client) GetVDIByID(ctx context.Context, id object.VDI) (VDI, error) {
	resp, err := c.cli.Get(ctx, c.k.vdiID(id))
	if err != nil {
		return VDI{}, fmt.Errorf("membership: get vdi %08x: %w", uint32(id), err)
	}
	if len(resp.Kvs) == 0 {
		return VDI{}, fmt.Errorf("membership: vdi %08x: %w", uint32(id), ErrNoVDI)
	}
	v, err := c.GetVDI(ctx, string(resp.Kvs[0].Value))
	if err == nil && v.ID != id {
		// Deleted and recreated between the two reads.
		return VDI{}, fmt.Errorf("membership: vdi %08x: %w", uint32(id), ErrNoVDI)
	}
	return v, err
}

// ListVDIs returns every VDI, sorted by name. The caller owns the slice.
func (c *Client) ListVDIs(ctx context.Context) ([]VDI, error) {
	resp, err := c.cli.Get(ctx, c.k.vdiNames(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: list vdis: %w", err)
	}
	vs := make([]VDI, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		v, err := decodeVDI(kv.Value)
		if err != nil {
			return nil, err
		}
		vs = append(vs, v)
	}
	return vs, nil
}

// DeleteVDI removes the VDI named name and writes its tombstone. It
// refuses with a *LockedError while a holder has the VDI's lock, and
// returns ErrNoVDI for an unknown name. It returns the deleted record.
func (c *Client) DeleteVDI(ctx context.Context, name string) (VDI, error) {
	for {
		v, _, mod, err := c.getVDI(ctx, name)
		if err != nil {
			return VDI{}, err
		}
		tb, err := json.Marshal(Tombstone{ID: v.ID, Name: v.Name, Size: v.Size, Deleted: c.now().UTC()})
		if err != nil {
			return VDI{}, fmt.Errorf("membership: delete vdi %q: %w", name, err)
		}
		lk := c.k.lock(v.ID)
		resp, err := c.cli.Txn(ctx).If(
			clientv3.Compare(clientv3.ModRevision(c.k.vdiName(name)), "=", mod),
			clientv3.Compare(clientv3.CreateRevision(lk), "=", 0),
		).Then(
			clientv3.OpDelete(c.k.vdiName(name)),
			clientv3.OpDelete(c.k.vdiID(v.ID)),
			clientv3.OpDelete(c.k.owner(v.ID)),
			clientv3.OpDelete(c.k.allocs(v.ID), clientv3.WithPrefix()),
			clientv3.OpDelete(c.k.unsynceds(v.ID), clientv3.WithPrefix()),
			clientv3.OpPut(c.k.tomb(v.ID), string(tb)),
		).Else(
			clientv3.OpGet(lk),
		).Commit()
		if err != nil {
			return VDI{}, fmt.Errorf("membership: delete vdi %q: %w", name, err)
		}
		if resp.Succeeded {
			return v, nil
		}
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			l, err := decodeLock(kvs[0])
			if err != nil {
				return VDI{}, err
			}
			return VDI{}, fmt.Errorf("membership: delete: %w", &LockedError{Name: name, Holder: l.Holder})
		}
		// The record changed under us (resized): try again.
	}
}

// ListTombstones returns the deleted VDIs, by id. The caller owns the
// slice.
func (c *Client) ListTombstones(ctx context.Context) ([]Tombstone, error) {
	resp, err := c.cli.Get(ctx, c.k.tombs(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: list tombstones: %w", err)
	}
	ts := make([]Tombstone, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var t Tombstone
		if err := json.Unmarshal(kv.Value, &t); err != nil {
			return nil, fmt.Errorf("membership: tombstone %s %q: %w", kv.Key, kv.Value, err)
		}
		ts = append(ts, t)
	}
	return ts, nil
}

// ResizeVDI sets the size of the VDI named name. A smaller size is
// refused unless shrink is true (the data past the new end is lost).
// The new size is validated as in CreateVDI. It returns the new record.
func (c *Client) ResizeVDI(ctx context.Context, name string, size int64, shrink bool) (VDI, error) {
	for {
		v, _, mod, err := c.getVDI(ctx, name)
		if err != nil {
			return VDI{}, err
		}
		if size < v.Size && !shrink {
			return VDI{}, fmt.Errorf("membership: resize vdi %q: size %d is below %d and shrinking was not allowed: %w", name, size, v.Size, ErrInvalid)
		}
		nv := v
		nv.Size = size
		// Copies were checked at creation; zones may have shrunk since.
		if err := ValidateVDI(nv, Format{}, MaxCopies); err != nil {
			return VDI{}, fmt.Errorf("membership: resize %w", err)
		}
		b, err := json.Marshal(nv)
		if err != nil {
			return VDI{}, fmt.Errorf("membership: resize vdi %q: %w", name, err)
		}
		resp, err := c.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(c.k.vdiName(name)), "=", mod)).
			Then(clientv3.OpPut(c.k.vdiName(name), string(b))).
			Commit()
		if err != nil {
			return VDI{}, fmt.Errorf("membership: resize vdi %q: %w", name, err)
		}
		if resp.Succeeded {
			return nv, nil
		}
	}
}

// sortLocks orders locks by name.
func sortLocks(ls []Lock) {
	slices.SortFunc(ls, func(a, b Lock) int { return strings.Compare(a.Name, b.Name) })
}
