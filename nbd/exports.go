package nbd

import (
	"context"
	"errors"
	"fmt"
)

// This file holds the set of exports a server offers, looked up when a
// client asks for one, and the fixed list most servers use.

// Exports is the set of exports a Server offers. The Server asks it at
// run time, each time a client names an export or lists them, so the set
// may change while the server runs (a cluster's virtual disks); a
// connection keeps the Export it was given until it ends.
//
// The Server never modifies a returned Export, and reads it for as long
// as a connection it was given to lasts: it must not change meanwhile.
// The Server checks each returned Export as Config.Validate checks a
// fixed list (a device, names and descriptions of at most 4096 bytes, a
// size that is not negative) and refuses one that fails as unavailable.
//
// Implementations must be safe for concurrent use: every connection's
// handshake calls them from its own goroutine.
type Exports interface {
	// Lookup returns the export called name, or an error wrapping
	// ErrUnknownExport when there is none: the client is told the export
	// is not present, in qemu-nbd's words. Any other error is logged and
	// the client is told the export is not available. The empty name is
	// a client asking for the default export: when Lookup finds none by
	// that name, the Server serves the first export List returns, unless
	// Config.ExactNames. ctx ends with the handshake (its timeout) and
	// with the Server's Close.
	Lookup(ctx context.Context, name string) (*Export, error)
	// List returns the exports NBD_OPT_LIST shows, in that order. An
	// error is logged, and the client is told the list is not available.
	List(ctx context.Context) ([]*Export, error)
}

// ErrUnknownExport is wrapped by the errors of Exports.Lookup for a name
// that names no export.
var ErrUnknownExport = errors.New("nbd: unknown export")

// FixedExports returns the Exports that serves exps, a list fixed when the
// server starts, in this order. Config.Validate checks it: at least one
// export, distinct names, a device for each, names and descriptions of at
// most 4096 bytes. The list is copied.
func FixedExports(exps ...Export) Exports {
	f := &fixedExports{list: append([]Export(nil), exps...)}
	f.byName = make(map[string]*Export, len(f.list))
	for i := range f.list {
		if _, dup := f.byName[f.list[i].Name]; !dup {
			f.byName[f.list[i].Name] = &f.list[i]
		}
	}
	return f
}

// fixedExports is FixedExports' list. It is never modified after
// FixedExports, so it needs no lock; its pointers are stable, which keeps
// a SET_META_CONTEXT selection valid for the GO that follows.
type fixedExports struct {
	list   []Export
	byName map[string]*Export
}

func (f *fixedExports) Lookup(_ context.Context, name string) (*Export, error) {
	if e, ok := f.byName[name]; ok {
		return e, nil
	}
	return nil, fmt.Errorf("%w %q", ErrUnknownExport, truncate(name))
}

func (f *fixedExports) List(context.Context) ([]*Export, error) {
	out := make([]*Export, len(f.list))
	for i := range f.list {
		out[i] = &f.list[i]
	}
	return out, nil
}

// validate is Config.Validate's check of the list, naming the offending
// export by its place.
func (f *fixedExports) validate() error {
	if len(f.list) == 0 {
		return errors.New("nbd: config: no exports")
	}
	seen := make(map[string]bool, len(f.list))
	for i := range f.list {
		e := &f.list[i]
		if e.Device == nil {
			return fmt.Errorf("nbd: config: export %d (%q) has no device", i, truncate(e.Name))
		}
		if len(e.Name) > maxStringLen {
			return fmt.Errorf("nbd: config: export %d name is %d bytes, more than %d", i, len(e.Name), maxStringLen)
		}
		if err := checkExport(e); err != nil {
			return fmt.Errorf("nbd: config: %w", err)
		}
		if seen[e.Name] {
			return fmt.Errorf("nbd: config: export name %q used twice", truncate(e.Name))
		}
		seen[e.Name] = true
	}
	return nil
}

// checkExport reports what makes e unservable: no device, a name or
// description longer than the protocol's strings, or a negative size.
func checkExport(e *Export) error {
	switch {
	case e.Device == nil:
		return fmt.Errorf("export %q has no device", truncate(e.Name))
	case len(e.Name) > maxStringLen:
		return fmt.Errorf("export name is %d bytes, more than %d", len(e.Name), maxStringLen)
	case len(e.Description) > maxStringLen:
		return fmt.Errorf("export %q description is %d bytes, more than %d", truncate(e.Name), len(e.Description), maxStringLen)
	case e.Device.Size() < 0:
		return fmt.Errorf("export %q has negative size %d", truncate(e.Name), e.Device.Size())
	}
	return nil
}

// lookup returns the export a client names: Exports.Lookup's, or for the
// empty name not found, unless Config.ExactNames, the first one listed.
// The export returned passed checkExport.
func (s *Server) lookup(ctx context.Context, name string) (*Export, error) {
	e, err := s.exports.Lookup(ctx, name)
	if name == "" && !s.cfg.ExactNames && errors.Is(err, ErrUnknownExport) {
		list, lerr := s.exports.List(ctx)
		switch {
		case lerr != nil:
			return nil, fmt.Errorf("nbd: listing exports for the default one: %w", lerr)
		case len(list) > 0:
			e, err = list[0], nil
		}
	}
	if err != nil {
		return nil, err
	}
	if e == nil {
		return nil, fmt.Errorf("nbd: export %q: lookup returned none", truncate(name))
	}
	if err := checkExport(e); err != nil {
		return nil, fmt.Errorf("nbd: %w", err)
	}
	return e, nil
}
